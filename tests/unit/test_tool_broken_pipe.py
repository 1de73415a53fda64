"""A tool's output piped into a reader that goes away (``python tools/plan.py ... | head -1``) ended in a
BrokenPipeError traceback (exit 1, or "Exception ignored ... BrokenPipeError" at the interpreter's exit):
every tool's ``__main__`` goes through :func:`megatron_lite.errors.run_tool`, which exits quietly with
141 (128 + SIGPIPE, as a shell reports for a program its reader left)."""

import ast
import glob
import os
import subprocess
import sys

import pytest

from megatron_lite.errors import SIGPIPE_EXIT_CODE, run_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# not through run_tool: the HTTP client imports nothing of megatron_lite (it runs anywhere), and
# run_lm_eval.py hands its whole command line to lm-eval's own entry point
OWN_ENTRY = {"text_generation_cli.py", "run_lm_eval.py"}


def _into_a_closed_pipe(argv, tmp_path):
    """Run ``python argv`` with stdout a pipe whose reader is gone already: its first write fails."""
    read, write = os.pipe()
    os.close(read)
    try:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        return subprocess.run([sys.executable, *argv], stdout=write, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env=env, timeout=300)
    finally:
        os.close(write)


@pytest.mark.parametrize("tool", ["plan", "preprocess_data"])
def test_a_reader_gone_is_a_quiet_exit(tool, tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n{"text": "4 5"}\n')
    argv = {"plan": ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                     "--vocab-size", "100", "--gpus", "8", "--global-batch-size", "8"],
            "preprocess_data": ["--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                                "NullTokenizer", "--vocab-size", "10", "--no-progress"]}[tool]
    done = _into_a_closed_pipe([os.path.join(ROOT, "tools", f"{tool}.py"), *argv], tmp_path)
    assert done.returncode == SIGPIPE_EXIT_CODE and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, \
        done.stderr


def test_run_tool_passes_the_exit_code_and_other_errors_through():
    assert run_tool(lambda: 3) == 3
    with pytest.raises(ValueError):
        run_tool(lambda: int("x"))


def test_every_tool_exits_through_run_tool():
    """A new tool writing ``sys.exit(main())`` would bring the traceback back."""
    for path in sorted(glob.glob(os.path.join(ROOT, "tools", "**", "*.py"), recursive=True)):
        if os.path.basename(path) in OWN_ENTRY:
            continue
        tree = ast.parse(open(path).read())
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        if mains:
            assert "run_tool(main)" in ast.unparse(mains[0]), f"{path}: exit through megatron_lite.errors.run_tool"
