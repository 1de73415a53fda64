"""pretrain_gpt.py as users launch it: torchrun processes, and SIGTERM handling. (A TP2 x PP2 job
under torchrun, its threads at exit, logging rank and checkpoint files: test_multinode.py.)"""

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


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _torchrun_counting_threads(tmp_path, world: int, script: str, argv: list[str]):
    """torchrun ``script`` (through exit_threads.py) on ``world`` ranks; (result, threads left at
    interpreter exit per rank). A successful run must exit 0 with only the main thread left: a
    communication thread alive then can abort it ("terminate called without an active exception")."""
    report = tmp_path / "threads"
    report.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "tests/e2e/exit_threads.py", script] + argv
    out = subprocess.run(cmd, cwd=ROOT, env=_env(EXIT_THREADS_DIR=str(report)), capture_output=True, text=True,
                         timeout=600)
    threads = [(report / f"rank{r}").read_text().splitlines() if (report / f"rank{r}").exists() else None
               for r in range(world)]
    return out, threads


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



def test_a_finished_run_with_work_in_flight_exits_0_with_no_thread_left(tmp_path):
    """Every source of work still running at the end of a run at once: expert parallelism with a
    shared expert, ZeRO-3 with overlapped gradient reduction and parameter all-gathers, and an
    asynchronous torch_dist save of the last iteration. With non-persistent saves in between and
    --save-retain-interval 4, rank 0 deletes iteration 2 once 4 landed and keeps the latest
    non-persistent checkpoint (3) only. The straggler detector is on (its HTTP switch served by rank 0's
    thread, closed at the end): every log line is followed by rank 0's report naming both ranks."""
    argv = TINY + ["--global-batch-size", "4", "--train-iters", "4", "--expert-model-parallel-size", "2",
                   "--num-experts", "4", "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "32",
                   "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
                   "--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
                   "--overlap-param-gather", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                   "--ckpt-format", "torch_dist", "--async-save", "--save-retain-interval", "4",
                   "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global",
                   "--log-straggler", "--straggler-ctrlr-port", str(free_port()), "--straggler-minmax-count", "2"]
    out, threads = _torchrun_counting_threads(tmp_path, 2, "pretrain_gpt.py", argv)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = [line for line in out.stdout.splitlines() if line.startswith(" straggler | iteration ")]
    assert [line.split(" | ")[1] for line in reports] == [f"iteration {i}" for i in range(1, 5)], out.stdout[-3000:]
    for line in reports:  # --straggler-minmax-count 2 of 2 ranks: both, each way
        for part in line.split(" | ")[3:5]:
            assert "rank 0 (tp 0 pp 0 dp 0)" in part and "rank 1 (tp 0 pp 0 dp 1)" in part, line
    assert threads == [threads[0], threads[0]] and len(threads[0]) == 1, threads
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000004", "latest_checkpointed_iteration.txt", "non_persistent"]
    assert sorted(os.listdir(tmp_path / "ckpt" / "non_persistent")) == ["iter_0000003", "latest_checkpointed_iteration.txt"]


def test_collectives_left_in_flight_end_cleanly(tmp_path):
    out, threads = _torchrun_counting_threads(tmp_path, 2, "tests/e2e/inflight_at_exit.py", [])
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(t is not None and len(t) == 1 for t in threads), threads
