"""Model-state bytes per parameter per rank: weights, gradient buffer, optimizer state.

This codebase keeps, per parameter: the weight in the params dtype; an fp32 gradient buffer
(``main_grad``, whatever the params dtype); AdamW's two fp32 moments; and an fp32 master copy
when the params are 16-bit (fp32 params are their own master). The distributed optimizer shards
the master and the moments over the d data-parallel ranks (the gradient buffer stays full-size:
ZeRO-1); it steps flat fp32 copies of its shard, so it keeps an fp32 master shard even for fp32
params. Bytes per parameter: bf16 or fp16 18, distributed ``6 + 12/d``; fp32 16, distributed
``8 + 12/d``. Hybrid sharding over N instances shards over d/N ranks only (``12N/d``); CPU
offload of a fraction f of the shard moves ``f x 12N/d`` to the host and adds a 4-byte host
gradient copy per offloaded element: bf16 device ``6 + (1-f) 12N/d``, host ``16 f N/d``.
(Megatron's table differs in two rows: fp16 20 / ``4 + 16/d``, because its fp16 runs keep fp16
gradients plus an fp32 copy, while here gradients are fp32 from the start; fp32 distributed
``8 + 8/d``, because Megatron's distributed optimizer steps fp32 params in place.)

:func:`measured_model_state_bytes` counts what a built model and optimizer actually hold, for a
test to compare with the formula.
"""

from __future__ import annotations

from fractions import Fraction

import torch


def _state_parts(params_dtype: torch.dtype, sharded_optimizer: bool) -> tuple[int, int, int]:
    """``(weight, gradient, optimizer)`` bytes per parameter before any sharding."""
    param = torch.empty((), dtype=params_dtype).element_size()
    separate_master = sharded_optimizer or params_dtype != torch.float32
    return param, 4, 8 + (4 if separate_master else 0)  # moments (+ fp32 master)


def model_state_bytes_split(params_dtype: torch.dtype, distributed_optimizer: bool = False, dp: int = 1, *,
                            instances: int = 1, offload_fraction: float = 0.0) -> tuple[Fraction, Fraction]:
    """(device, host) bytes per parameter on one rank (module docstring).

    ``dp`` is the size of the group the distributed optimizer shards over without hybrid sharding
    (data x context parallel); with ``instances`` it shards over ``dp / instances`` ranks only.
    ``offload_fraction`` of that shard keeps master and moments on the host, plus a host copy of
    its gradient: 16 bytes per offloaded element.
    """
    param, grad, optimizer = _state_parts(params_dtype, distributed_optimizer)
    shard = Fraction(dp, instances) if distributed_optimizer else Fraction(1)
    offloaded = Fraction(str(offload_fraction)) if distributed_optimizer else Fraction(0)
    device = param + grad + optimizer * (1 - offloaded) / shard
    host = (optimizer + grad) * offloaded / shard
    return device, host


def model_state_bytes_per_param(params_dtype: torch.dtype, distributed_optimizer: bool = False,
                                dp: int = 1, *, instances: int = 1, offload_fraction: float = 0.0) -> Fraction:
    """Bytes per parameter on one rank, device and host together (module docstring)."""
    device, host = model_state_bytes_split(params_dtype, distributed_optimizer, dp, instances=instances,
                                           offload_fraction=offload_fraction)
    return device + host


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def sharded_state_bytes_per_param(strategy: str, shard_size: int, params_dtype: torch.dtype = torch.bfloat16) -> Fraction:
    """Bytes per parameter on one rank when ``strategy`` shards over ``shard_size`` data-parallel ranks.

    ZeRO's stages, named as Megatron-FSDP's ``--data-parallel-sharding-strategy``: ``no_shard``
    (everything replicated), ``optim`` (master + moments sharded: ZeRO-1, the distributed
    optimizer), ``optim_grads`` (gradients too: ZeRO-2), ``optim_grads_params`` (weights too:
    ZeRO-3). For bf16: 18, 6 + 12/N, 2 + 16/N, 18/N. Only ``no_shard`` and ``optim`` are built
    here; the other two are for planning (transient gathered weights are not included).
    """
    if strategy in ("no_shard", "optim"):
        return model_state_bytes_per_param(params_dtype, strategy == "optim", shard_size)
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding strategy must be one of {', '.join(SHARDING_STRATEGIES)}, got {strategy!r}")
    param, grad, optimizer = _state_parts(params_dtype, True)
    if strategy == "optim_grads":
        return param + Fraction(grad + optimizer, shard_size)
    return Fraction(param + grad + optimizer, shard_size)


def _storage_bytes(tensors, skip=frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage once)."""
    sizes = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def measured_model_state_bytes(chunks, optimizer) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "optimizer_cpu"}`` bytes held by this rank, from storages.

    ``chunks``: the DistributedDataParallel-wrapped model chunks (their ``grad_buffer`` is the
    gradient memory); ``optimizer``: the Megatron optimizer; its torch optimizer's parameters
    that are not model weights are the fp32 masters, and its state tensors the moments (the
    0-dim step counters are left out). With optimizer CPU offload the host half's masters,
    moments and gradient copy are ``optimizer_cpu``; everything else is on the device.
    """
    model = [p for c in chunks for p in c.parameters()]
    model_storages = {p.untyped_storage().data_ptr() for p in model}
    inner = optimizer.optimizer
    host = list(inner.host_tensors()) if hasattr(inner, "host_tensors") else []
    host_storages = {t.untyped_storage().data_ptr() for t in host}
    tensors = []
    for group in inner.param_groups:
        for p in group["params"]:
            tensors.append(p)
            tensors += [v for v in inner.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "params": _storage_bytes(model),
        "grads": _storage_bytes(c.grad_buffer for c in chunks),
        "optimizer": _storage_bytes(tensors, model_storages | host_storages),
        "optimizer_cpu": _storage_bytes(host),
    }


def model_state_report(config, chunks, optimizer, dp_cp: int) -> str:
    """One line: the bytes per parameter this rank holds (measured) next to the formula for the
    run's data-parallel sharding strategy (no_shard or optim here); ``dp_cp`` is the size of the
    group the optimizer shards over without hybrid sharding (data x context parallel)."""
    p, o = config.parallel, config.optim
    strategy = getattr(p, "data_parallel_sharding_strategy", "optim" if p.use_distributed_optimizer else "no_shard")
    instances = p.num_distributed_optimizer_instances
    fraction = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    n = sum(q.numel() for c in chunks for q in c.parameters())
    per = {k: v / max(n, 1) for k, v in measured_model_state_bytes(chunks, optimizer).items()}
    line = (f"model state on this rank, bytes per parameter ({n:,} params): params {per['params']:.2f} + grads "
            f"{per['grads']:.2f} + optimizer {per['optimizer']:.2f} = device "
            f"{per['params'] + per['grads'] + per['optimizer']:.2f}; optimizer on CPU {per['optimizer_cpu']:.2f}")
    if strategy not in ("no_shard", "optim"):
        return line
    device, host = model_state_bytes_split(config.precision.params_dtype, strategy == "optim", dp_cp,
                                           instances=instances, offload_fraction=fraction)
    return (line + f" | formula for {strategy} (d={dp_cp}, instances {instances}, offload {fraction:g}): "
            f"device {float(device):.2f}, CPU {float(host):.2f}")
