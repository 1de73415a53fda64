"""What a ``pretrain`` run builds before its first step: the model chunks (wrapped for data parallelism),
the optimizer and the learning-rate schedule, restored from ``--load`` when given, and where the
resumed run's training and validation data continue."""

from __future__ import annotations

from typing import NamedTuple

from ..checkpoint import load_checkpoint
from ..checkpoint.load_source import check_no_initialization
from ..config import Config
from ..console import print_rank_0
from ..data.builder import consumed_valid_samples
from ..errors import ConfigError
from ..lora.apply import lora_chunks
from ..models.transformer import compile_layers
from ..optim import OptimizerParamScheduler, build_optimizer
from ..optim.lr_scheduler import build_scheduler
from ..parallel.fsdp import wrap_for_data_parallel
from ..parallel.state import ParallelState
from .batch_rampup import validation_batch
from .dp_random_init import broadcast_from_first_replica
from .eval_batch import eval_config


class Built(NamedTuple):
    chunks: list
    optimizer: object
    scheduler: OptimizerParamScheduler
    iteration: int
    consumed_samples: int
    consumed_valid_samples: int | None = None  # as the checkpoint recorded it (None: not recorded)
    loaded_from: str | None = None  # the folder of the checkpoint resumed: --load, or the non-persistent one


SCHEDULER_METHODS = ("step", "get_lr", "state_dict", "load_state_dict")  # what the loop and checkpoints call


def check_scheduler(scheduler) -> None:
    """A ``scheduler_provider``'s schedule lacking a method the loop calls: one line naming them, before any step."""
    missing = [name for name in SCHEDULER_METHODS if not callable(getattr(scheduler, name, None))]
    if missing:
        raise ConfigError(f"scheduler_provider returned a {type(scheduler).__name__} without {', '.join(missing)}: "
                          f"pretrain's schedule needs {', '.join(SCHEDULER_METHODS)} (or subclass "
                          "megatron_lite.optim.OptimizerParamScheduler)")


def build_run(config: Config, state: ParallelState, device, model_provider, scheduler_provider=build_scheduler) -> Built:
    """The model chunks (wrapped for data parallelism), the optimizer and the learning-rate schedule,
    restored from ``--load`` when given, with the iteration and consumed samples to resume from."""
    ck = config.checkpoint
    check_no_initialization(config)  # a checkpoint must overwrite the weights it leaves as allocated
    chunks = [chunk.to(device) for chunk in lora_chunks(model_provider(config, state), config, state)]  # --lora-rank
    if config.training.data_parallel_random_init:  # the replicas drew with their own seeds: start from the first's
        broadcast_from_first_replica(chunks, state)
    if config.fusion.torch_compile:  # regional compile of the layers, before the data-parallel wrapper
        compiled = sum(compile_layers(chunk, config.fusion.torch_compile_backend) for chunk in chunks)
        print_rank_0(f"> torch.compile ({config.fusion.torch_compile_backend}): {compiled} transformer layers share "
                     "one compiled forward; the loss's pieces compile too")
    chunks = [wrap_for_data_parallel(chunk, state, config.parallel) for chunk in chunks]
    optimizer = build_optimizer(config, chunks, state)
    scheduler = scheduler_provider(config, optimizer)
    check_scheduler(scheduler)
    loaded = (0, 0)
    if ck.load or ck.pretrained_checkpoint:
        loaded = load_checkpoint(chunks, optimizer, scheduler, config, state)
    return Built(chunks, optimizer, scheduler, *loaded, getattr(loaded, "consumed_valid_samples", None),
                  getattr(loaded, "source", None))


def resumed_validation(config: Config, built: Built) -> int:
    """Where a resumed run's validation continues: the samples the checkpoint's run had read, as it
    recorded them (so another --eval-interval or --eval-iters continues from there, as in Megatron-LM),
    or, for a checkpoint without the record, what this run's flags would have read by its iteration."""
    if built.consumed_valid_samples is not None:
        return built.consumed_valid_samples
    t = config.training
    return consumed_valid_samples(built.iteration, validation_batch(eval_config(config)), t.eval_interval, t.eval_iters)
