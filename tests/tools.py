"""Import the scripts under tools/ (a folder of scripts, not a package) from tests."""

import importlib.util
import os

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tools")


def load_tool(name):
    """The module object of ``tools/<name>.py``."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}", os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
