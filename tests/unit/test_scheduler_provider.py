"""pretrain(..., scheduler_provider=...): a learning-rate schedule that is not a flag, from a script.
The loop builds it instead of the flags' schedule, steps it once per optimizer step, and saves and
restores it with checkpoints like the default one, so a resumed run continues it exactly."""

import pretrain_gpt
from megatron_lite.arguments import parse_args
from megatron_lite.optim import OptimizerParamScheduler
from megatron_lite.optim.lr_scheduler import build_scheduler
from megatron_lite.training.loop import pretrain
from tests.trajectory import Trajectory

ARGV = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-2",
        "--lr-decay-style", "linear", "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1",
        "--seed", "3", "--train-iters", "6"]


class HalvingSchedule(OptimizerParamScheduler):
    """A step schedule no flag gives: --lr halved every 2 optimizer steps; records each lr it sets."""

    def __init__(self, *args, **kwargs):
        self.set_lrs = []
        super().__init__(*args, **kwargs)

    def get_lr(self, decoupled: bool = False) -> float:
        return self.max_lr * 0.5 ** (self.num_steps // 2)

    def step(self, increment: int = 1) -> float:
        lr = super().step(increment)
        if increment:
            self.set_lrs.append((self.num_steps, lr))
        return lr


def _train(argv):
    """Train with HalvingSchedule; the trajectory and the schedule the run built."""
    built = []

    def halving(config, optimizer):
        t = config.training
        built.append(HalvingSchedule(optimizer, config.optim, t.train_iters, t.train_samples, t.global_batch_size))
        return built[-1]

    config = parse_args(argv, world_size=1)
    tokenizer = pretrain_gpt.build_tokenizer_for(config)
    pretrain_gpt.set_vocab(config, tokenizer)
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                      pretrain_gpt.make_datasets_provider(tokenizer), scheduler_provider=halving)
    return Trajectory.of(result), built[0]


def test_a_custom_schedule_is_used_and_resumes_exactly(tmp_path):
    whole, schedule = _train(ARGV)
    assert schedule.set_lrs == [(n, 1e-2 * 0.5 ** (n // 2)) for n in range(1, 7)]  # not the flags' linear decay
    save = str(tmp_path / "ckpt")
    first, _ = _train(ARGV + ["--save", save, "--exit-interval", "3"])
    rest, resumed = _train(ARGV + ["--load", save])
    assert len(first) == 3 and len(rest) == 3
    assert resumed.num_steps == 6 and resumed.set_lrs == schedule.set_lrs[3:]  # continued from step 3
    assert first + rest == whole  # bit for bit: losses and gradient norms


def test_the_default_provider_is_the_flags_schedule():
    import torch

    config = parse_args(ARGV, world_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    flags = build_scheduler(config, optimizer)
    assert type(flags) is OptimizerParamScheduler and flags.style == "linear" and flags.decay_steps == 6


class PlainSchedule:
    """A schedule that is no OptimizerParamScheduler: only the four documented methods (lr = --lr / steps)."""

    def __init__(self, optimizer, lr):
        self.optimizer, self.lr, self.num_steps = optimizer, lr, 0
        self.step(0)

    def get_lr(self) -> float:
        return self.lr / (1 + self.num_steps)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr()
        return self.get_lr()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.num_steps = int(sd["num_steps"])
        self.step(0)


def _train_plain(argv, provider=None):
    config = parse_args(argv, world_size=1)
    tokenizer = pretrain_gpt.build_tokenizer_for(config)
    pretrain_gpt.set_vocab(config, tokenizer)
    built = []

    def plain(config, optimizer):
        built.append(PlainSchedule(optimizer, config.optim.lr))
        return built[-1]

    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                      pretrain_gpt.make_datasets_provider(tokenizer), scheduler_provider=provider or plain)
    return Trajectory.of(result), built


def test_a_schedule_with_only_the_documented_methods_trains_ramps_up_and_resumes(tmp_path):
    """The loop needs step / get_lr / state_dict / load_state_dict only: not the default schedule's
    sample counting (``unit``, ``step_size``), also under --rampup-batch-size and --train-samples."""
    whole, built = _train_plain(ARGV)
    assert built[0].num_steps == 6
    save = str(tmp_path / "ckpt")
    first, _ = _train_plain(ARGV + ["--save", save, "--exit-interval", "3"])
    rest, resumed = _train_plain(ARGV + ["--load", save])
    assert resumed[0].num_steps == 6 and first + rest == whole
    dropped = ("--train-iters", "--global-batch-size", "--lr-warmup-iters")  # counted in samples instead
    ramp = [a for i, a in enumerate(ARGV) if a not in dropped and (i == 0 or ARGV[i - 1] not in dropped)]
    ramped, built = _train_plain(ramp + ["--global-batch-size", "4", "--train-samples", "16",
                                         "--rampup-batch-size", "2", "2", "4"])  # batches 2, 2, 4, 4, 4
    assert len(ramped) == built[0].num_steps == 5  # one schedule step per optimizer step, whatever the batch


def test_a_schedule_without_the_documented_methods_is_refused_in_one_line():
    """scheduler_provider returning something else is one line naming the missing methods, before any step."""
    import pytest

    from megatron_lite.errors import ConfigError

    class NoState:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, increment=1):
            return 0.0

        def get_lr(self):
            return 0.0

    with pytest.raises(ConfigError) as err:
        _train_plain(ARGV, provider=lambda config, optimizer: NoState(optimizer))
    assert "state_dict, load_state_dict" in str(err.value) and "NoState" in str(err.value)
    assert "\n" not in str(err.value)
