"""A real two-node job on one machine: two torchrun launchers, ``--nnodes 2``, one c10d rendezvous.

Each launcher stands for one node and starts 2 processes; the 4 ranks form TP2 x PP2 across the two
"nodes" exactly as on a cluster (the rendezvous assigns node ranks, ranks 0-1 live on one launcher
and 2-3 on the other: a TP pair per node, the pipeline crossing nodes). Everything binds to 127.0.0.1
only. The per-iteration losses the job prints (``lm loss: %.6E``, 7 significant digits) must equal
the single-process run's within a relative 1e-5, and the gradient norms it prints (``grad norm:
%.3f``) the single-process ones within that rounding (half a unit of the third decimal) plus a
relative 1e-5. As for any torchrun launch, every rank exits 0 with only its main thread left at
interpreter exit (tests/e2e/exit_threads.py), one rank (the last stage's first) prints the iteration
lines, and each of the 4 model-parallel ranks saves its own checkpoint file.
"""

import os
import re
import subprocess
import sys

import pretrain_gpt
from tests.e2e.conftest import ROOT
from tests.harness import free_port

ITERS = 3
ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--mock-data", "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "1e-2", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--seed", "11",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*\| lm loss: ([0-9.E+-]+) \|.*\| grad norm: ([0-9.]+) \|")


def _launcher(port: int, save) -> list[str]:
    """What one node runs (the same command on both, as ``srun`` would start it)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-node-test",
        "--local-addr", "127.0.0.1", "tests/e2e/exit_threads.py", "pretrain_gpt.py",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--save", str(save),
    ] + ARGV


def _printed_losses(stdout: str) -> dict[int, tuple[float, float]]:
    """``{iteration: (lm loss, grad norm)}`` as the log lines print them."""
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in LOSS.finditer(stdout)}


def test_two_node_rendezvous_matches_single_process(tmp_path):
    threads = tmp_path / "threads"
    threads.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               EXIT_THREADS_DIR=str(threads))
    save = tmp_path / "ckpt"
    cmd = _launcher(free_port(), save)
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    # no communication thread alive at interpreter exit (one can abort a finished run)
    left = [(threads / f"rank{r}").read_text().splitlines() if (threads / f"rank{r}").exists() else None
            for r in range(4)]
    assert all(t is not None and len(t) == 1 for t in left), left
    printed = [_printed_losses(out) for out, _ in outputs]
    assert sorted(len(p) for p in printed) == [0, ITERS]  # one logging rank, on one of the two nodes
    lines = [line for out, _ in outputs for line in out.splitlines() if "iteration" in line and "lm loss" in line]
    assert len(lines) == ITERS, lines  # printed once per iteration
    losses = printed[0] or printed[1]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    files = sorted(p.parent.name for p in (save / f"iter_{ITERS:07d}").glob("mp_rank_*/model_optim_rng.pt"))
    assert files == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]

    reference = pretrain_gpt.main(ARGV)
    assert len(reference.losses) == len(reference.grad_norms) == ITERS
    for step, (loss, norm) in enumerate(zip(reference.losses, reference.grad_norms, strict=True), 1):
        got_loss, got_norm = losses[step]
        assert abs(got_loss - loss) <= 1e-5 * abs(loss), f"step {step}: loss {got_loss} vs {loss}"
        assert abs(got_norm - norm) <= 5e-4 + 1e-5 * norm, f"step {step}: grad norm {got_norm} vs {norm}"
    assert reference.losses[-1] < reference.losses[0]  # it trained
