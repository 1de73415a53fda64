"""Validation of the data-parallel sharding flags (kept out of config.py, which only calls it).

``--data-parallel-sharding-strategy`` (Megatron-FSDP's names) says what is sharded over the data
(x context) parallel ranks: ``no_shard`` nothing, ``optim`` the optimizer state (ZeRO-1, what
``--use-distributed-optimizer`` means), ``optim_grads`` also the gradients (ZeRO-2),
``optim_grads_params`` also the parameters (ZeRO-3). ``--use-megatron-fsdp`` is accepted and
changes nothing. Every strategy but ``no_shard`` uses the distributed optimizer.
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
    if strategy in ("optim_grads", "optim_grads_params") and p.pipeline_schedule == "zb-h1":
        raise ConfigError(f"--pipeline-schedule zb-h1 defers weight gradients, which --data-parallel-sharding-strategy "
                          f"{strategy} reduces in every backward pass; use --pipeline-schedule 1f1b or strategy optim")
    if strategy == "optim_grads_params" and config.precision.fp8_format is not None:
        raise ConfigError("--fp8-format is not supported with --data-parallel-sharding-strategy optim_grads_params; "
                          "use strategy optim_grads or drop --fp8-format")
