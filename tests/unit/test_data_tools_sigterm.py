"""A data tool killed with SIGTERM (``kill PID``, a scheduler's time limit, ``timeout``) cleans up as on
Ctrl-C: exit 143, one line, no temporary ``.bin/.idx`` or partition folder left next to the outputs
(the default action ended the process before any ``finally`` ran, leaving them all)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs a tool's main() in a fresh process whose ``builder_method`` sends this process SIGTERM on its
# third call: deterministic, unlike a kill from outside at a moment that depends on the machine's speed.
KILL_AT_THIRD = """
import importlib.util, os, signal, sys
import megatron_lite.data.preprocess as pp
import megatron_lite.data.sft_preprocess as sp
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder
pp.CHUNK_LINES = sp.CHUNK_LINES = 4
method, tool, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
real, calls = getattr(IndexedDatasetBuilder, method), []
def killed_at_third(self, *args):
    calls.append(1)
    if len(calls) == 3 and os.environ.get("CTRL_C"):  # as a terminal's Ctrl-C: SIGINT to the whole group
        os.killpg(0, signal.SIGINT)
    elif len(calls) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(self, *args)
setattr(IndexedDatasetBuilder, method, killed_at_third)
spec = importlib.util.spec_from_file_location("tool", os.path.join("tools", tool + ".py"))
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.exit(module.main(argv))
"""


def _run_killed(method, tool, argv, ctrl_c=False):
    """``ctrl_c``: SIGINT to the tool's process group (its own session, workers included) instead of SIGTERM."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), CTRL_C="1" if ctrl_c else "")
    return subprocess.run([sys.executable, "-c", KILL_AT_THIRD, method, tool, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, start_new_session=True)


@pytest.mark.parametrize("workers,partitions", [(1, 1), (2, 2)])
def test_sigterm_during_preprocess_leaves_nothing(tmp_path, workers, partitions):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"{i % 7} {i % 5} 3"}) + "\n" for i in range(40)))
    out = tmp_path / "out"
    out.mkdir()
    proc = _run_killed("add_documents", "preprocess_data", [
        "--input", str(src), "--output-prefix", str(out / "o"), "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "10", "--no-progress", "--workers", str(workers), "--partitions", str(partitions)])
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip() == "interrupted: no output written", proc.stderr
    assert os.listdir(out) == []


def test_sigterm_during_merge_leaves_nothing(tmp_path):
    shards = tmp_path / "shards"
    for name in "abcd":
        with IndexedDatasetBuilder(str(shards / name), np.uint16) as builder:
            builder.add_document([1, 2, 3], [3])
    out = tmp_path / "out"
    out.mkdir()
    proc = _run_killed("add_index", "merge_datasets", ["--input", str(shards), "--output-prefix", str(out / "m")])
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip() == "interrupted: no output written", proc.stderr
    assert os.listdir(out) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_during_preprocess_sft_is_one_line(tmp_path, workers):
    """Ctrl-C reaches every process of the group: the spawned tokenizer workers printed a KeyboardInterrupt
    traceback each (they did not ignore SIGINT, as preprocess_data's workers do)."""
    from tests.sft_helpers import hf_tokenizers, write_conversations

    tok = hf_tokenizers(tmp_path / "tok")["chatml"]
    src = write_conversations(str(tmp_path / "chats.jsonl"), 40)
    out = tmp_path / "out"
    out.mkdir()
    proc = _run_killed("add_document", "preprocess_sft", [
        "--input", src, "--output-prefix", str(out / "o"), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", tok.path, "--no-progress", "--workers", str(workers)], ctrl_c=True)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "interrupted: no output written", proc.stderr
    assert os.listdir(out) == []
