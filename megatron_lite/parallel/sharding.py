"""Validation of the data-parallel sharding flags (kept out of config.py, which only calls it).

``--data-parallel-sharding-strategy`` (Megatron-FSDP's names) says what is sharded over the data
(x context) parallel ranks: ``no_shard`` nothing, ``optim`` the optimizer state (ZeRO-1, what
``--use-distributed-optimizer`` means), ``optim_grads`` also the gradients (ZeRO-2),
``optim_grads_params`` also the parameters (ZeRO-3). ``--use-megatron-fsdp`` is accepted and
changes nothing. Every strategy but ``no_shard`` uses the distributed optimizer.

Hybrid sharding (``--num-distributed-optimizer-instances N``) chooses the group every sharded
strategy shards over (one of N instances; with ``optim_grads``/``optim_grads_params`` that is HSDP:
gradients, and parameters, sharded inside an instance, replicated across them), and CPU offload
(``--optimizer-cpu-offload``) moves part of the optimizer's shard to the host: both need the
distributed optimizer (any strategy but ``no_shard``). Whether N divides the data-parallel x
context-parallel size (and, with MoE, the expert data-parallel size) is checked by the rank grid,
which knows those sizes.
"""

from __future__ import annotations

from ..errors import ConfigError


def check_sharding(config) -> None:
    """Resolve the strategy (``--use-distributed-optimizer`` alone means ``optim``) and refuse what
    does not compose; raises ConfigError with one line."""
    p = config.parallel
    strategy = p.data_parallel_sharding_strategy
    if strategy == "no_shard" and p.use_distributed_optimizer:
        strategy = p.data_parallel_sharding_strategy = "optim"
    p.use_distributed_optimizer = strategy != "no_shard"
    if p.overlap_param_gather:
        if strategy == "no_shard":
            raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer or a "
                              "--data-parallel-sharding-strategy other than no_shard")
        if not p.overlap_grad_reduce:
            raise ConfigError("--overlap-param-gather needs --overlap-grad-reduce")
    _check_hybrid_and_offload(config, strategy)


def _check_hybrid_and_offload(config, strategy: str) -> None:
    p, o = config.parallel, config.optim
    instances = p.num_distributed_optimizer_instances
    if instances < 1:
        raise ConfigError(f"--num-distributed-optimizer-instances must be at least 1, got {instances}")
    if instances > 1 and not p.use_distributed_optimizer:
        raise ConfigError("--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer or a "
                          "--data-parallel-sharding-strategy other than no_shard (hybrid sharding splits the "
                          "distributed optimizer's shard group)")
    if not 0.0 <= o.optimizer_offload_fraction <= 1.0:
        raise ConfigError(f"--optimizer-offload-fraction must be between 0 and 1, got {o.optimizer_offload_fraction}")
    if o.optimizer_cpu_offload and not p.use_distributed_optimizer:
        raise ConfigError("--optimizer-cpu-offload needs --use-distributed-optimizer (it offloads that "
                          "optimizer's shard); add it")
    if o.overlap_cpu_optimizer_d2h_h2d and not o.optimizer_cpu_offload:
        raise ConfigError("--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload; add it or drop this flag")
    if o.optimizer_offload_fraction != 1.0 and not o.optimizer_cpu_offload:
        raise ConfigError("--optimizer-offload-fraction needs --optimizer-cpu-offload; add it or drop this flag")
