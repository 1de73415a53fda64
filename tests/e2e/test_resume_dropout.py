"""Resuming with dropout on continues bit for bit: stopped cleanly, or killed with SIGKILL at any moment.

The uninterrupted 8-iteration run is the reference; a run stopped (or killed) part-way and resumed
with ``--load`` must report exactly the same losses for every iteration after the checkpoint.
"""

import os
import re
import signal
import subprocess
import sys

import pytest

import pretrain_gpt
from tests.e2e import kill_at
from tests.e2e.conftest import ROOT
from tests.harness import run_in_new_process
from tests.trajectory import assert_same_trajectory, run_trajectory

DROPOUT = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "123", "--mock-data", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
    "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0", "--seed", "11",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "8",
]


def _run(argv):
    return pretrain_gpt.main(argv).losses


def _losses(world, argv):
    """The trajectory (losses and gradient norms) of ``argv`` on ``world`` ranks."""
    return run_trajectory(world, "pretrain_gpt", argv)


def _layout(world):
    return [] if world == 1 else ["--tensor-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """``straight(world)``: the uninterrupted run on ``world`` ranks (saving every iteration, which
    must not change it), run once per world size for every test of this module."""
    runs = {}

    def get(world):
        if world not in runs:
            save = str(tmp_path_factory.mktemp(f"straight{world}"))
            runs[world] = _losses(world, DROPOUT + _layout(world) + ["--save-interval", "1", "--save", save])
        return runs[world]

    return get


@pytest.mark.parametrize("world", [1, 2])
def test_resume_with_dropout_is_bit_identical(tmp_path, straight, world):
    extra = _layout(world)
    save = str(tmp_path / "resumed")
    first = _losses(world, DROPOUT + extra + ["--save", save, "--save-interval", "4", "--exit-interval", "4"])
    second = _losses(world, DROPOUT + extra + ["--save", save, "--load", save])
    assert len(first) == 4 and len(second) == 4
    assert_same_trajectory(first + second, straight(world), rtol=0)  # bit-identical


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MEGATRON_LITE_DEVICE="cpu")


def _kill_run(world, moment, iteration, argv):
    """Run ``argv`` in new processes (torchrun for 2 ranks; one process: forked, torch already
    imported) killed with SIGKILL at ``moment``; their stdout."""
    args = [moment, str(iteration)] + argv
    if world == 1:
        code, stdout, stderr = run_in_new_process(kill_at.main, args, env={"MEGATRON_LITE_DEVICE": "cpu"})
        assert code == -signal.SIGKILL, stderr[-2000:]
        return stdout
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    out = subprocess.run(launch + ["tests/e2e/kill_at.py"] + args, cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0, "the run was not killed"
    assert f"exitcode  : -{int(signal.SIGKILL)} " in out.stderr, out.stderr[-2000:]  # torchrun's summary
    return out.stdout


@pytest.mark.parametrize(
    "world, moment, kill_at, resumes_at",
    [(1, "step", 6, 5), (1, "tracker", 5, 5), (1, "save", 1, 0), (2, "save", 5, 4)],
)
def test_sigkill_at_any_moment_then_resume_is_bit_identical(tmp_path, straight, world, moment, kill_at, resumes_at):
    """Save every iteration; kill in an iteration's step (after its gradients, before the optimizer
    step), in the middle of its save (on both ranks of a torchrun launch), or right after the tracker
    names it. The resumed run continues from the newest complete checkpoint (from scratch when the
    very first save was cut short)."""
    argv = DROPOUT + _layout(world) + ["--save-interval", "1"]
    save = str(tmp_path / "killed")
    stdout = _kill_run(world, moment, kill_at, argv + ["--save", save])
    last_logged = kill_at - 1 if moment == "step" else kill_at  # a step killed before its log line
    assert re.search(rf"iteration +{last_logged}/", stdout)
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    if resumes_at:
        with open(tracker) as f:
            assert int(f.read()) == resumes_at
    else:
        assert not os.path.exists(tracker)
    resumed = _losses(world, argv + ["--save", save, "--load", save])
    assert_same_trajectory(resumed, straight(world)[resumes_at:], rtol=0)  # bit-identical


def test_sigterm_during_start_up_is_honoured_at_the_first_step(tmp_path):
    """The handler is installed before anything else: a SIGTERM while the checkpoint loads saves
    at the first step boundary and exits 0 (not killed with -15)."""
    save = str(tmp_path / "ckpt")
    _run(DROPOUT + ["--save", save, "--train-iters", "2"])
    cmd = [sys.executable, "pretrain_gpt.py"] + DROPOUT + [
        "--train-iters", "100000", "--save", save, "--load", save, "--exit-signal-handler",
        "--override-opt_param-scheduler"]  # a longer run than the checkpoint's: its own schedule
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "parallel layout" in line:  # start-up is under way: nothing built or loaded yet
                proc.send_signal(signal.SIGTERM)
                break
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "exit on signal" in stdout
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == 3
