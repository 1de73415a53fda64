"""Validation of the hybrid-sharding and optimizer-offload flags (kept out of config.py).

Both build on the distributed optimizer: hybrid sharding chooses the group it shards over, CPU
offload moves part of its shard to the host. Without it there is no shard, so both are refused.
Whether N divides the data-parallel size is checked by the rank grid, which knows that size.
"""

from __future__ import annotations

from ..errors import ConfigError


def check_sharding_flags(config) -> None:
    """Raise :class:`ConfigError` (one line naming the flag) for a combination that cannot work."""
    p, o = config.parallel, config.optim
    instances = p.num_distributed_optimizer_instances
    if instances < 1:
        raise ConfigError(f"--num-distributed-optimizer-instances must be at least 1, got {instances}")
    if instances > 1 and not p.use_distributed_optimizer:
        raise ConfigError("--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer "
                          "(hybrid sharding splits the distributed optimizer's shard group)")
    if instances > 1 and config.moe.num_experts:
        raise ConfigError("--num-distributed-optimizer-instances > 1 is not supported with --num-experts "
                          "(expert parameters shard over their own group); use 1 instance")
    if not 0.0 <= o.optimizer_offload_fraction <= 1.0:
        raise ConfigError(f"--optimizer-offload-fraction must be between 0 and 1, got {o.optimizer_offload_fraction}")
    if o.optimizer_cpu_offload and not p.use_distributed_optimizer:
        raise ConfigError("--optimizer-cpu-offload needs --use-distributed-optimizer (it offloads that "
                          "optimizer's shard); add it")
    if o.overlap_cpu_optimizer_d2h_h2d and not o.optimizer_cpu_offload:
        raise ConfigError("--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload; add it or drop this flag")
    if o.optimizer_offload_fraction != 1.0 and not o.optimizer_cpu_offload:
        raise ConfigError("--optimizer-offload-fraction needs --optimizer-cpu-offload; add it or drop this flag")
