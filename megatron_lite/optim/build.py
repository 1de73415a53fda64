"""Choose the optimizer class for a run (kept apart so the two optimizer modules need not import each other)."""

from __future__ import annotations

from .distrib_optimizer import DistributedOptimizer
from .optimizer import MegatronOptimizer


def build_optimizer(config, chunks, state) -> MegatronOptimizer:
    """The optimizer for ``config`` over the params of ``chunks`` (DistributedDataParallel wrappers)."""
    p = config.parallel  # every sharding strategy but no_shard shards the optimizer state
    if p.use_distributed_optimizer or p.data_parallel_sharding_strategy != "no_shard":
        return DistributedOptimizer(chunks, state, config.optim, config.precision)
    return MegatronOptimizer(chunks, state, config.optim, config.precision)
