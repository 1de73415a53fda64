"""pretrain_gpt.py with --rampup-batch-size: each step's global batch, consumed samples, learning
rate and scheduled weight decay follow the ramp's table (the schedules count consumed samples, as
Megatron-LM's do, not steps); a checkpoint is saved where the batch grows; a run resumed mid-ramp
continues bit for bit; DP 2 and PP 2 reproduce the single-process run; --decrease-batch-size-if-needed
trains the rounded-down batches."""

import io
import os
import re
import sys

import pytest

import pretrain_gpt
from megatron_lite.arguments import parse_args
from megatron_lite.optim.lr_scheduler import OptimizerParamScheduler
from tests.e2e.test_pretrain_gpt import MODEL
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectories, run_script

WARMUP = MODEL.index("--lr-warmup-iters")
BASE = MODEL[:WARMUP] + MODEL[WARMUP + 2:] + ["--micro-batch-size", "2"]
# 2 -> 8 by 2 over 10 samples, then 8 a step: 7 steps of 2, 2, 4, 6, 8, 8, 8 out of 40 samples (38 used)
RAMP = BASE + ["--global-batch-size", "8", "--train-samples", "40", "--rampup-batch-size", "2", "2", "10",
               "--lr-warmup-samples", "6", "--lr-decay-samples", "40",
               "--weight-decay-incr-style", "linear", "--start-weight-decay", "0", "--end-weight-decay", "0.4"]
BATCHES = [2, 2, 4, 6, 8, 8, 8]
CONSUMED = [2, 4, 8, 14, 22, 30, 38]


def _expected_wd(consumed: int) -> float:
    """The linear weight decay after ``consumed`` of the 40 samples: 0 + 0.4 * consumed / 40 (a
    schedule counting steps would reach 0.4 after the 7th step, and pass 0.08 mid-ramp)."""
    return 0.4 * consumed / 40


def _decays(result) -> list[float]:
    return [group["weight_decay"] for group in result.optimizer.param_groups]


STEP = re.compile(r"iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.* learning rate: (\S+) \|"
                  r" global batch size: +(\d+) \|")


def _steps(out: str) -> list[tuple[int, int, str, int]]:
    """(iteration, consumed samples, learning rate as printed, global batch) of every log line."""
    return [(int(m[1]), int(m[2]), m[3], int(m[4])) for m in STEP.finditer(out)]


def _expected_lr(consumed: int) -> str:
    """The learning rate the sample schedule gives after ``consumed`` samples, as the log prints it."""
    config = parse_args(RAMP, world_size=1)

    class _Opt:
        param_groups = [{}]

    sched = OptimizerParamScheduler(_Opt(), config.optim, config.training.train_iters, config.training.train_samples,
                                    config.training.global_batch_size)
    sched.num_steps = consumed
    return f"{sched.get_lr():.6E}"


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run (saving only where the batch grows, and at the end) and its stdout."""
    save = tmp_path_factory.mktemp("whole")
    capture, out = pytest.MonkeyPatch(), io.StringIO()
    capture.setattr(sys, "stdout", out)
    try:
        result = pretrain_gpt.main(RAMP + ["--save", str(save)])
    finally:
        capture.undo()
    return result, out.getvalue(), save


def test_steps_follow_the_ramp_table(whole):
    result, out, save = whole
    assert result.iteration == 7 and result.consumed_samples == 38
    steps = _steps(out)
    assert [s[0] for s in steps] == list(range(1, 8))
    assert [s[3] for s in steps] == BATCHES
    assert [s[1] for s in steps] == CONSUMED
    assert [s[2] for s in steps] == [_expected_lr(c) for c in CONSUMED]  # the schedule advances by each batch
    assert _decays(result) == [pytest.approx(_expected_wd(38), rel=1e-12), 0.0]  # so does the weight decay's
    assert "ramping up batch size from 2 to 4" in out and "ramping up batch size from 6 to 8" in out
    # as Megatron-LM: a checkpoint before each step whose micro-batch count grows (after 2, 3, 4), and the last
    saved = sorted(name for name in os.listdir(save) if name.startswith("iter_"))
    assert saved == ["iter_0000002", "iter_0000003", "iter_0000004", "iter_0000007"]


def test_a_run_resumed_mid_ramp_continues_exactly(whole, tmp_path, capsys):
    result, _, _ = whole
    first = pretrain_gpt.main(RAMP + ["--save", str(tmp_path / "part"), "--exit-interval", "3"])
    assert first.iteration == 3 and first.consumed_samples == 8
    assert _decays(first) == [pytest.approx(_expected_wd(8), rel=1e-12), 0.0]  # mid-ramp: 8 of 40 samples
    capsys.readouterr()
    rest = pretrain_gpt.main(RAMP + ["--load", str(tmp_path / "part"), "--save", str(tmp_path / "rest")])
    out = capsys.readouterr().out
    assert rest.iteration == 7 and rest.consumed_samples == 38
    assert [s[3] for s in _steps(out)] == BATCHES[3:] and [s[1] for s in _steps(out)] == CONSUMED[3:]
    assert "this run starts at 6" in out
    assert Trajectory.of(first) + Trajectory.of(rest) == Trajectory.of(result)  # bit for bit
    assert rest.optimizer.param_groups[0]["lr"] == result.optimizer.param_groups[0]["lr"]
    assert _decays(rest) == _decays(result)


def test_data_and_pipeline_parallel_runs_equal_the_single_process_run():
    # DP 2 (and PP 2) x mbs 2: 4 -> 12 by 4 over 16 samples: steps of 4, 4, 8, 12, 12, 12, 12 (64 samples)
    argv = BASE + ["--global-batch-size", "12", "--train-samples", "64", "--rampup-batch-size", "4", "4", "16"]
    single = run_script("pretrain_gpt", argv)
    assert len(single) == 7
    dp2, pp2 = ranks_trajectories(2, "pretrain_gpt", [argv, argv + ["--pipeline-model-parallel-size", "2"]])
    assert_same_trajectory(dp2, single, what="DP 2")
    assert_same_trajectory(pp2, single, what="PP 2")


def test_decrease_batch_size_if_needed_trains_the_rounded_batches(capsys):
    # 2 -> 6 by 1 over 8 samples at micro-batch 2: the ramp's 3 and 5 are rounded down to 2 and 4. The
    # iterations are counted on the ramp's own sizes (2 + 3 + 4, then (21 - 9) // 6 = 2 more), as Megatron-LM does
    argv = BASE + ["--global-batch-size", "6", "--train-samples", "21", "--rampup-batch-size", "2", "1", "8",
                   "--decrease-batch-size-if-needed"]
    result = pretrain_gpt.main(argv)
    steps = _steps(capsys.readouterr().out)
    assert [s[3] for s in steps] == [2, 2, 4, 6, 6] and [s[1] for s in steps] == [2, 4, 8, 14, 20]
    assert result.iteration == 5 and result.consumed_samples == 20


def test_a_resumed_run_validates_on_the_rounded_down_batches_the_whole_run_would(tmp_path):
    """--decrease-batch-size-if-needed, global batch 7 at micro-batch 2: each validation iteration reads 6
    samples. A run resumed at iteration 2 started its validation data at 7 per iteration read so far (the
    unrounded batch), so its validation at iteration 4 read other samples than the uninterrupted run's."""
    argv = BASE + ["--global-batch-size", "7", "--decrease-batch-size-if-needed", "--train-iters", "4",
                   "--eval-interval", "2", "--eval-iters", "1"]
    whole = pretrain_gpt.main(argv)
    first = pretrain_gpt.main(argv + ["--save", str(tmp_path / "part"), "--exit-interval", "2"])
    rest = pretrain_gpt.main(argv + ["--load", str(tmp_path / "part")])
    assert Trajectory.of(first) + Trajectory.of(rest) == Trajectory.of(whole)  # the same weights throughout
    assert [it for it, _ in whole.validation] == [2, 4]
    assert first.validation + rest.validation == whole.validation  # bit for bit, on the same samples
