"""A weight-decay schedule through pretrain_gpt.py: it changes the run (against constant decay), the
matrices' group ends at the formula's decay and biases/norms keep 0, and a run saved half-way
resumes bit for bit (torch and torch_dist), the schedule restored from the checkpoint."""

import pytest

import pretrain_gpt
from tests.e2e.test_pretrain_gpt import MODEL, _argv
from tests.trajectory import Trajectory

ITERS = 4
WD = ["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.0", "--end-weight-decay", "0.5"]


def _run(tmp_path, name, extra):
    result = pretrain_gpt.main(_argv(str(tmp_path / name), ITERS, MODEL + extra))
    return result, Trajectory.of(result)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_schedule_changes_the_run_and_resumes_exactly(tmp_path, fmt):
    ckpt = ["--ckpt-format", fmt]
    full, traj = _run(tmp_path, "full", WD + ckpt)
    groups = full.optimizer.param_groups
    assert groups[0]["weight_decay"] == pytest.approx(0.5)  # past the end (step 4 of 4): --end-weight-decay
    assert all(g["weight_decay"] == 0.0 for g in groups[1:])  # biases and norms
    _, constant = _run(tmp_path, "constant", ckpt)  # MODEL's --weight-decay 0.1 throughout
    assert traj.losses[2:] != constant.losses[2:]
    src = str(tmp_path / "half")
    pretrain_gpt.main(_argv(src, ITERS, MODEL + WD + ckpt + ["--exit-interval", "2"]))
    resumed, rtraj = _run(tmp_path, "resumed", WD + ckpt + ["--load", src])
    assert rtraj.losses == traj.losses[-len(rtraj.losses):] and len(rtraj.losses) == 2
    assert rtraj.grad_norms == traj.grad_norms[-2:]
    assert resumed.optimizer.param_groups[0]["weight_decay"] == groups[0]["weight_decay"]
