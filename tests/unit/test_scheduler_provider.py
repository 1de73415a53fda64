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
