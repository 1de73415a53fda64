"""pretrain_gpt.py as users launch it: torchrun processes, and SIGTERM handling."""

import os
import signal
import subprocess
import sys

from tests.e2e.conftest import ROOT
from tests.harness import free_port

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--mock-data", "--vocab-size", "100", "--micro-batch-size", "2", "--log-interval", "1", "--eval-iters", "0",
]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def test_torchrun_tensor_and_pipeline_parallel(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-port", str(free_port()),
           "pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--global-batch-size", "8", "--train-iters", "3", "--save", str(tmp_path / "ckpt")] + TINY
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "iteration" in line and "lm loss" in line]
    assert len(lines) == 3, out.stdout[-3000:]  # one line per iteration, from one rank only
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    files = sorted(p.parent.name for p in (tmp_path / "ckpt" / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"))
    assert files == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]


def test_sigterm_saves_and_exits_zero(tmp_path):
    save = tmp_path / "ckpt"
    cmd = [sys.executable, "pretrain_gpt.py", "--train-iters", "100000", "--save", str(save),
           "--exit-signal-handler"] + TINY
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # wait until training is under way
            if "iteration        3/" in line:
                break
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 100000
    assert (save / f"iter_{saved:07d}" / "mp_rank_00_000" / "model_optim_rng.pt").exists()
    assert "exit on signal" in stdout

