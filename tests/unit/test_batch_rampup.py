"""--rampup-batch-size START INCREMENT SAMPLES (Megatron-LM's batch-size ramp-up): the global batch of
each step against hand-made tables, the iterations --train-samples gives, --decrease-batch-size-if-needed,
the refusals (one line, exit 2) and what the log line says of a ramped step."""

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.config import Config
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training.batch_rampup import BatchSchedule, data_config_for_resume, end_at_train_samples
from megatron_lite.training.logging import TrainLogger
from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "8"]


def _schedule(argv, world_size=1):
    return BatchSchedule.from_config(parse_args(BASE + argv, world_size=world_size))


# ramp 2 -> 8 by 2 over 10 samples: 3 increments, one every 10/3 samples (floor(c * 3 / 10) of them)
RAMP_2_2_10 = [  # (consumed samples at the step's start, global batch, micro-batches with mbs 2, DP 1)
    (0, 2, 1), (2, 2, 1), (3, 2, 1), (4, 4, 2), (6, 4, 2), (7, 6, 3), (9, 6, 3),
    (10, 8, 4),  # c == SAMPLES: the last increment is reached
    (11, 8, 4), (14, 8, 4), (10**6, 8, 4),
]


@pytest.mark.parametrize("consumed, batch, micro", RAMP_2_2_10)
def test_the_ramp_follows_the_hand_table(consumed, batch, micro):
    s = _schedule(["--train-samples", "40", "--rampup-batch-size", "2", "2", "10"])
    assert (s.nominal(consumed), s.batch(consumed), s.microbatches(consumed)) == (batch, batch, micro)


def test_micro_batches_count_per_data_parallel_rank():
    # DP 2 x mbs 2: ramp 4 -> 12 by 4 over 16 samples (one increment every 8 samples)
    argv = ["--global-batch-size", "12", "--train-samples", "64", "--rampup-batch-size", "4", "4", "16"]
    s = _schedule(argv, world_size=2)
    assert [(c, s.batch(c), s.microbatches(c)) for c in (0, 4, 8, 16, 28)] == [
        (0, 4, 1), (4, 4, 1), (8, 8, 2), (16, 12, 3), (28, 12, 3)]


@pytest.mark.parametrize("train_samples, iters", [
    # the ramp takes 2 + 2 + 4 + 6 = 14 samples in 4 steps, then full batches of 8 (a partial one dropped)
    (40, 4 + 3), (80, 4 + 8), (14, 4), (21, 4), (22, 5),
    (8, 3),  # fewer samples than the ramp: only the steps that fit (2 + 2 + 4)
])
def test_train_samples_gives_the_ramps_steps_then_full_batches(train_samples, iters):
    config = parse_args(BASE + ["--train-samples", str(train_samples), "--rampup-batch-size", "2", "2", "10"],
                        world_size=1)
    assert config.training.train_iters == iters
    assert config.optim.lr_decay_samples == train_samples  # the schedule still counts --train-samples


@pytest.mark.parametrize("gbs, iters", [
    (8, 7),  # this run's own ramp (2 + 2 + 4 + 6 = 14 in 4 steps): its own count, 4 + (40 - 14) // 8 = 7
    (4, 4 + 6),  # from the checkpoint's 14 samples: 6 batches of 4 (counted from the start: 12 iterations, to sample 46)
    (16, 4 + 1),  # one batch of 16 (counted from the start: 4 iterations, no step left, 26 samples untrained)
])
def test_a_ramp_resumed_with_other_batch_flags_ends_at_its_samples(gbs, iters):
    """Checkpoint: 4 steps of the ramp 2 2 10 to 8 (14 samples). Resumed with another --global-batch-size,
    the iterations counted from the start read past the 40 samples (4: a StopIteration traceback) or
    stop short of them (16); the run now ends once --train-samples are trained."""
    argv = BASE[:-1] + [str(gbs), "--train-samples", "40", "--rampup-batch-size", "2", "2", "10"]
    config = parse_args(argv, world_size=1)
    end_at_train_samples(config, 4, 14)
    assert config.training.train_iters == iters
    schedule, consumed = BatchSchedule.from_config(config), 14
    for _ in range(iters - 4):
        consumed += schedule.batch(consumed)
    assert consumed <= 40 and 40 - consumed < gbs


def test_a_ramp_resumed_with_its_own_flags_keeps_its_count():
    """With --decrease-batch-size-if-needed the loop consumes the rounded batches (6, 6, 12 ...) and
    the count is the nominal one's: recounting from the checkpoint would end the run elsewhere."""
    argv = ["--global-batch-size", "12", "--train-samples", "120", "--rampup-batch-size", "6", "2", "12",
            "--decrease-batch-size-if-needed"]
    config = parse_args(BASE + argv, world_size=3)
    whole, schedule = config.training.train_iters, BatchSchedule.from_config(config)
    assert [schedule.consumed_after(k) for k in (0, 1, 2, 3, 5)] == [0, 6, 12, 24, 48]
    for k in range(1, whole):
        end_at_train_samples(config, k, schedule.consumed_after(k))
        assert config.training.train_iters == whole


def test_a_resume_at_a_smaller_batch_builds_the_training_set_for_the_samples_it_reads():
    # saved after 4 iterations of 8 samples (32 consumed), resumed at --global-batch-size 4 for --train-iters 8:
    # the 4 iterations left read samples 32..47, past the 8 x 4 = 32 --train-iters x --global-batch-size gives
    config = parse_args(BASE + ["--train-iters", "8", "--global-batch-size", "4"], world_size=1)
    data = data_config_for_resume(config, 4, 32)
    assert data.training.train_samples == 32 + 4 * 4 and data.training.train_iters == 8
    assert config.training.train_samples is None  # the run's own config is unchanged
    assert data_config_for_resume(config, 4, 16) is config  # saved at this batch: nothing to change
    assert data_config_for_resume(config, 0, 0) is config


@pytest.mark.parametrize("iteration, consumed, iters", [
    (4, 32, 4 + 8 // 2),  # saved at batch 8: the 8 samples left take 4 iterations of 2
    (10, 20, 20),  # saved at this batch: --train-samples / --global-batch-size, as without a resume
    (4, 40, 4),  # every sample trained: the run ends where it is
    (0, 0, 20),  # a fresh run
])
def test_a_train_samples_run_resumed_at_another_batch_ends_with_its_samples(iteration, consumed, iters):
    config = parse_args(BASE + ["--train-samples", "40", "--global-batch-size", "2"], world_size=1)
    assert config.training.train_iters == 20
    assert data_config_for_resume(config, iteration, consumed) is config
    assert config.training.train_iters == iters
    ramped = parse_args(BASE + ["--train-samples", "40", "--rampup-batch-size", "2", "2", "10"], world_size=1)
    data_config_for_resume(ramped, 4, 32)
    # 32 samples in 4 steps is not this run's ramp (14): it ends once the 8 samples left are trained at batch 8
    assert ramped.training.train_iters == 4 + (40 - 32) // 8


def test_start_equal_to_the_global_batch_is_a_constant_batch():
    s = _schedule(["--train-samples", "40", "--rampup-batch-size", "8", "2", "10"])
    assert {s.batch(c) for c in (0, 5, 10, 11)} == {8}
    assert parse_args(BASE + ["--train-samples", "40", "--rampup-batch-size", "8", "2", "10"],
                      world_size=1).training.train_iters == 5


def test_decrease_batch_size_if_needed_rounds_each_batch_down():
    # DP 3 x mbs 2 = 6: the ramp 6, 8, 10, 12 trains on 6, 6, 6, 12 samples (1, 1, 1, 2 micro-batches)
    argv = ["--global-batch-size", "12", "--train-samples", "120", "--rampup-batch-size", "6", "2", "12",
            "--decrease-batch-size-if-needed"]
    s = _schedule(argv, world_size=3)
    assert [(s.nominal(c), s.batch(c), s.microbatches(c)) for c in (0, 4, 8, 12)] == [
        (6, 6, 1), (8, 6, 1), (10, 6, 1), (12, 12, 2)]
    # without a ramp: a global batch of 10 at DP 3 x mbs 2 runs 6 samples
    const = _schedule(["--global-batch-size", "10", "--decrease-batch-size-if-needed"], world_size=3)
    assert (const.nominal(0), const.batch(0), const.microbatches(0)) == (10, 6, 1)


@pytest.mark.parametrize("extra, world, words", [
    (["--train-iters", "10", "--rampup-batch-size", "2", "2", "8"], 1, ["needs sample-based training", "--train-samples"]),
    (["--rampup-batch-size", "2", "2", "8"], 1, ["needs sample-based training"]),  # the --train-iters default
    (["--train-samples", "80", "--rampup-batch-size", "3", "2", "8"], 1,
     ["--global-batch-size 8 must be the start batch plus a whole number of increments", "not a multiple of 2"]),
    (["--train-samples", "80", "--rampup-batch-size", "10", "2", "8"], 1, ["must be the start batch plus"]),
    (["--train-samples", "80", "--rampup-batch-size", "0", "2", "8"], 1, ["must each be at least 1"]),
    (["--train-samples", "80", "--rampup-batch-size", "2", "2", "0"], 1, ["must each be at least 1"]),
    (["--train-samples", "80", "--rampup-batch-size", "2", "3", "8"], 1,
     ["the ramp's global batch 5 is not divisible by --micro-batch-size 2 x data-parallel size 1",
      "--decrease-batch-size-if-needed"]),
    (["--train-samples", "80", "--rampup-batch-size", "2", "2", "8"], 2,  # 2 and 6 do not split over DP 2 x 2
     ["the ramp's global batch 2 is not divisible by --micro-batch-size 2 x data-parallel size 2"]),
    (["--train-samples", "80", "--rampup-batch-size", "2", "2", "8", "--decrease-batch-size-if-needed"], 2,
     ["the start batch 2 is less than one micro-batch per data-parallel rank"]),
    (["--global-batch-size", "2", "--decrease-batch-size-if-needed"], 2,
     ["--decrease-batch-size-if-needed: --global-batch-size 2 is less than --micro-batch-size 2 x data-parallel size 2"]),
    (["--train-samples", "80", "--rampup-batch-size", "2", "1", "8", "--micro-batch-size", "1", "--num-layers", "4",
      "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     ["--rampup-batch-size 2 1 8: at global batch 3", "interleaved pipeline schedule", "= 3"]),
    (["--train-samples", "80", "--rampup-batch-size", "2", "2"], 1, ["--rampup-batch-size", "expected 3 argument"]),
])
def test_a_bad_ramp_is_one_line_exit_2(extra, world, words, capsys):
    parse_refused(capsys, BASE + extra, *words, world_size=world)


def test_the_log_line_shows_the_steps_batch_and_its_share_of_the_flops(capsys):
    cfg = Config()
    cfg.training.global_batch_size, cfg.training.train_iters = 8, 10
    cfg.logging.log_interval, cfg.logging.log_throughput = 2, True
    log = TrainLogger(cfg, ParallelState(), flops_per_iteration=2e12)  # FLOPs of a full batch of 8
    common = dict(lr=1e-3, grad_norm=1.0, loss_scale=1.0, skipped=False, nan=False, iter_time_s=0.1)
    log.log_iteration(1, {"lm loss": 1.0}, batch_size=4, **common)
    line = log.log_iteration(2, {"lm loss": 1.0}, batch_size=4, **common)
    assert "global batch size:     4 |" in line and "consumed samples:            8 |" in line
    assert "(TFLOP/s/GPU): 10.0 |" in line  # half a batch: 1e12 FLOPs in 0.1 s
    log.log_iteration(3, {"lm loss": 1.0}, batch_size=6, **common)
    line = log.log_iteration(4, {"lm loss": 1.0}, batch_size=8, **common)
    assert "global batch size:     8 |" in line  # the last step's, not the interval's mean
    assert "(TFLOP/s/GPU): 17.5 |" in line and "consumed samples:           22 |" in line


def test_the_check_args_summary_names_the_ramp():
    from megatron_lite.arguments import args_summary

    config = parse_args(BASE + ["--train-samples", "40", "--rampup-batch-size", "2", "2", "10"], world_size=1)
    assert args_summary(config).endswith("x DP 1, ramped up from 2 by 2 over 10 samples (7 iterations)")
    assert "ramped" not in args_summary(parse_args(BASE, world_size=1))


def test_the_check_args_summary_of_a_rounded_down_batch_adds_up():
    """--decrease-batch-size-if-needed with a global batch of 7 at micro-batch 2 trains 6 a step; the
    summary said 'global batch 7 = micro-batch 2 x 3 micro-batches x DP 1' (2 x 3 x 1 is 6)."""
    from megatron_lite.arguments import args_summary

    config = parse_args(BASE[:-1] + ["7", "--decrease-batch-size-if-needed"], world_size=1)
    assert "global batch 7 rounded down to 6 = micro-batch 2 x 3 micro-batches x DP 1" in args_summary(config)
    assert "rounded" not in args_summary(parse_args(BASE, world_size=1))
