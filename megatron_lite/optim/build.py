"""Choose the optimizer class for a run (kept apart so the two optimizer modules need not import each other)."""

from __future__ import annotations

from .distrib_optimizer import DistributedOptimizer
from .optimizer import MegatronOptimizer


def build_optimizer(config, chunks, state) -> MegatronOptimizer:
    """The optimizer for ``config`` over the params of ``chunks`` (DistributedDataParallel wrappers)."""
    if config.parallel.use_distributed_optimizer:
        return DistributedOptimizer(chunks, state, config.optim, config.precision)
    return MegatronOptimizer(chunks, state, config.optim, config.precision)
