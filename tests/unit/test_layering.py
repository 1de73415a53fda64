"""The package's layers point one way: the checkpoint format never imports the training loop.

Checked twice: statically (every ``import`` statement in the package source, module-level or inside a
function, followed transitively, parent packages included) and at run time (importing every
checkpoint module in a fresh interpreter loads no ``megatron_lite.training`` module). Modules a tool
imports first load in a fresh interpreter (no import cycle through them).
"""

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_lite"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The megatron_lite modules that ``path`` imports (anywhere in the file)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    # importing a.b.c runs a/__init__.py and a/b/__init__.py first
    return found | {p for t in found for p in _parents(t) if p in modules}


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@functools.cache  # parsed once per session (~1 s); the tests only read it
def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from ``start``, mapped to the module that imports it (for the message)."""
    seen, todo = {start: ""}, [start]
    while todo:
        current = todo.pop()
        for target in graph[current]:
            if target not in seen:
                seen[target] = current
                todo.append(target)
    return seen


def _chain(seen: dict[str, str], end: str) -> str:
    chain = [end]
    while seen[chain[-1]]:
        chain.append(seen[chain[-1]])
    return " -> ".join(reversed(chain))


def test_the_import_graph_sees_known_edges():
    """The parser resolves relative imports (else the layering check below could never fail)."""
    graph = _graph()
    assert "megatron_lite.checkpoint.training" in graph["megatron_lite.training.loop"] or \
        "megatron_lite.checkpoint" in graph["megatron_lite.training.loop"]
    assert "megatron_lite.console" in graph["megatron_lite.checkpoint.training"]
    assert "megatron_lite.console" in graph["megatron_lite.training.logging"]


@pytest.mark.parametrize("layer", ["checkpoint", "console", "config", "models"])
def test_lower_layers_never_import_training(layer):
    """The checkpoint format, the config and the models sit below the training loop."""
    graph = _graph()
    starts = [name for name in graph if name == f"megatron_lite.{layer}" or
              name.startswith(f"megatron_lite.{layer}.")]
    assert starts
    for start in starts:
        seen = _reachable(graph, start)
        bad = sorted(m for m in seen if m == "megatron_lite.training" or m.startswith("megatron_lite.training."))
        assert not bad, f"{start} reaches the training loop: {_chain(seen, bad[0])}"


def test_importing_every_checkpoint_module_loads_no_training_module():
    """Then (same interpreter) importing pretrain_gpt.py loads no Dynamo: torch.compiler.disable at
    import time did (about 1 s of every start of a tool, a refused flag or a generation server)."""
    names = sorted(n for n in _graph() if n.startswith("megatron_lite.checkpoint"))
    code = (f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\n"
            "print(sorted(m for m in sys.modules if m.startswith('megatron_lite.training')))\n"
            "import pretrain_gpt\nprint('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.split() == ["[]", "False"], out.stdout


@pytest.mark.parametrize("entry", ["megatron_lite.perf.flops"])
def test_modules_import_first_in_a_fresh_interpreter(entry):
    """A module imported before any other (as tools/plan.py imports the planner) loads without a cycle:
    the FLOPs count reads the models' per-layer windows, the models reach the FP8 GEMMs, and those time
    a GEMM (perf.matmul_peak, not perf.flops)."""
    out = subprocess.run([sys.executable, "-c", f"import {entry}"], capture_output=True, text=True,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]


def test_plan_tool_starts():
    out = subprocess.run([sys.executable, str(PACKAGE.parent / "tools" / "plan.py"), "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "--window-size" in out.stdout, out.stderr[-2000:]
