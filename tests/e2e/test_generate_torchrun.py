"""tools/generate.py under torchrun runs at the checkpoint's saved layout (here TP2, no layout flags)
and prints what one process prints: the same tokens of a seeded top-k sample and the same
log-probs (printed with 4 decimals: within 2e-4)."""

import os
import subprocess
import sys

from megatron_lite.checkpoint.reshard import TargetLayout, load_megatron, save_megatron
from tests.e2e.conftest import ROOT
from tests.harness import free_port
from tests.inference_helpers import prompts, save_model
from tests.tools import load_tool


def _parse(out: str):
    """(texts, [(token, log-prob)]) of generate.py's output."""
    texts = [line for line in out.splitlines() if line and not line.startswith("  ")]
    scored = [(int(line.split()[0]), float(line.split()[1])) for line in out.splitlines() if line.startswith("  ")]
    return texts, scored


def test_generate_under_torchrun_at_the_saved_layout_equals_one_process(tmp_path, capsys):
    one, tp2 = str(tmp_path / "one"), str(tmp_path / "tp2")
    save_model("rope_gqa", one)
    save_megatron(load_megatron(one), tp2, TargetLayout(tp=2, pp=1))
    capsys.readouterr()  # the saver's report
    argv = ["--load", tp2, "--top-k", "4", "--seed", "3", "--max-new-tokens", "8", "--log-probs"]
    for p in prompts(2):
        argv += ["--prompt", " ".join(map(str, p))]
    assert load_tool("generate").main(argv) == 0
    want = _parse(capsys.readouterr().out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "tools/generate.py", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_LITE_DEVICE="cpu")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _parse(proc.stdout)
    assert got[0] == want[0] and len(want[0]) == 2
    assert [t for t, _ in got[1]] == [t for t, _ in want[1]]
    assert all(abs(a - b) <= 2e-4 for (_, a), (_, b) in zip(got[1], want[1]))
