"""--train-samples and the sample-based learning-rate schedule (Megatron-LM's flags): iterations are
train-samples // global-batch-size, the schedule counts samples (a global batch per step), and the
iteration flags are refused with it, as the sample flags are without it."""

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.config import Config
from megatron_lite.config_checks import finalize
from megatron_lite.optim.lr_scheduler import OptimizerParamScheduler
from tests.cli_errors import parse_refused

GBS = 8
BASE = ["--mock-data", "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", str(GBS),
        "--lr", "1e-3", "--min-lr", "1e-5"]
# (iteration flags, the same schedule in samples): warmup 10, decay 100 of 120 steps, WSD decay 20
CASES = {
    "linear": (["--lr-decay-style", "linear", "--lr-warmup-iters", "10", "--lr-decay-iters", "100"],
               ["--lr-decay-style", "linear", "--lr-warmup-samples", "80", "--lr-decay-samples", "800"]),
    "linear-default-decay": (["--lr-decay-style", "linear", "--lr-warmup-iters", "10"],
                             ["--lr-decay-style", "linear", "--lr-warmup-samples", "80"]),
    "cosine": (["--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--lr-decay-iters", "100"],
               ["--lr-decay-style", "cosine", "--lr-warmup-samples", "80", "--lr-decay-samples", "800"]),
    "cosine-fraction": (["--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.15"],
                        ["--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.15"]),
    "WSD": (["--lr-decay-style", "WSD", "--lr-warmup-iters", "10", "--lr-decay-iters", "100",
             "--lr-wsd-decay-iters", "20", "--lr-wsd-decay-style", "cosine"],
            ["--lr-decay-style", "WSD", "--lr-warmup-samples", "80", "--lr-decay-samples", "800",
             "--lr-wsd-decay-samples", "160", "--lr-wsd-decay-style", "cosine"]),
    "WSD-exponential-default-decay": (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30"],
                                      ["--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "240"]),
}


def _lrs(argv, steps=130):
    """The learning rate after each of ``steps`` optimizer steps, built as the training loop builds it."""
    config = parse_args(BASE + argv, world_size=1)
    t = config.training
    assert t.train_iters == 120
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OptimizerParamScheduler(opt, config.optim, t.train_iters, t.train_samples, t.global_batch_size)
    return [opt.param_groups[0]["lr"]] + [sched.step(1) for _ in range(steps)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_sample_schedule_equals_the_iteration_schedule_step_by_step(case):
    iters, samples = CASES[case]
    by_iters = _lrs(["--train-iters", "120"] + iters)
    by_samples = _lrs(["--train-samples", str(120 * GBS)] + samples)
    assert len(set(by_iters)) > 10  # the schedule moves: warmup, decay, floor
    assert by_samples == pytest.approx(by_iters, rel=1e-12, abs=1e-15)


def test_train_iters_from_train_samples_and_its_default():
    assert parse_args(BASE + ["--train-samples", str(5 * GBS + 3)], world_size=1).training.train_iters == 5
    config = parse_args(BASE, world_size=1)
    assert config.training.train_iters == 20 and config.training.train_samples is None
    assert config.optim.lr_decay_iters == 20
    direct = Config()
    direct.data.mock_data, direct.model.vocab_size = True, 64
    assert finalize(direct).training.train_iters == 20  # a Config built in code keeps the default


@pytest.mark.parametrize("extra, words", [
    (["--train-iters", "10", "--train-samples", "80"], ["--train-iters and --train-samples exclude each other"]),
    (["--train-samples", "80", "--lr-decay-iters", "5"], ["--lr-decay-iters counts iterations", "--lr-decay-samples"]),
    (["--train-samples", "80", "--lr-warmup-iters", "2"], ["--lr-warmup-iters counts", "--lr-warmup-samples"]),
    (["--train-samples", "80", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"],
     ["--lr-wsd-decay-iters counts", "--lr-wsd-decay-samples"]),
    (["--lr-decay-samples", "80"], ["--lr-decay-samples needs --train-samples", "use --lr-decay-iters"]),
    (["--train-iters", "10", "--lr-warmup-samples", "8"], ["--lr-warmup-samples needs --train-samples"]),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2", "--lr-wsd-decay-samples", "8"],
     ["--lr-wsd-decay-samples needs --train-samples"]),
    (["--train-samples", "7"], ["--train-samples 7 is less than one global batch", "--global-batch-size 8"]),
    (["--train-samples", "80", "--lr-decay-style", "WSD"], ["WSD needs --lr-wsd-decay-samples"]),
    (["--train-samples", "80", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "88"],
     ["0 < --lr-wsd-decay-samples <= --lr-decay-samples 80", "got 88"]),
    (["--train-samples", "80", "--lr-warmup-samples", "80"],
     ["--lr-decay-samples 80 (default --train-samples) must exceed --lr-warmup-samples 80"]),
    (["--train-samples", "80", "--lr-warmup-samples", "-8"], ["--lr-warmup-samples must be at least 0"]),
    (["--train-samples", "80", "--lr-warmup-samples", "8", "--lr-warmup-fraction", "0.1"],
     ["--lr-warmup-fraction and --lr-warmup-samples exclude each other"]),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"],
     ["--lr-warmup-fraction and --lr-warmup-iters exclude each other"]),
    (["--lr-warmup-fraction", "1"], ["--lr-warmup-fraction must be in [0, 1), got 1.0"]),
    (["--train-iters", "10", "--rampup-batch-size", "2", "2", "8"],
     ["--rampup-batch-size 2 2 8 needs sample-based training", "--train-samples"]),
])
def test_a_mixed_or_bad_length_flag_is_one_line_exit_2(extra, words, capsys):
    parse_refused(capsys, BASE + extra, *words, world_size=1)


def test_a_checkpoint_schedule_does_not_change_its_unit_on_resume():
    from megatron_lite.errors import ConfigError

    def sched(argv):
        config = parse_args(BASE + argv, world_size=1)
        t = config.training
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return OptimizerParamScheduler(opt, config.optim, t.train_iters, t.train_samples, t.global_batch_size)

    by_iters, by_samples = sched(["--train-iters", "10"]), sched(["--train-samples", "80"])
    by_iters.step(3)
    by_samples.step(3)
    assert by_samples.num_steps == 3 * GBS
    with pytest.raises(ConfigError, match="counts iterations, this run's samples: resume with --train-iters"):
        sched(["--train-samples", "80"]).load_state_dict(by_iters.state_dict())
    with pytest.raises(ConfigError, match="counts samples, this run's iterations: resume with --train-samples"):
        sched(["--train-iters", "10"]).load_state_dict(by_samples.state_dict())
    with pytest.raises(ConfigError, match=r"--lr-decay-samples \(default --train-samples\) 160 in this run, 80"):
        sched(["--train-samples", "160"]).load_state_dict(by_samples.state_dict())
    resumed = sched(["--train-samples", "80"])
    resumed.load_state_dict(by_samples.state_dict())
    assert resumed.num_steps == 3 * GBS and resumed.step(1) == by_samples.step(1)
