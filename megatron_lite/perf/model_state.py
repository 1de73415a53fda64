"""Model-state bytes per parameter per rank: weights, gradient buffer, optimizer state.

This codebase keeps, per parameter: the weight in the params dtype; an fp32 gradient buffer
(``main_grad``, whatever the params dtype); AdamW's two fp32 moments; and an fp32 master copy
when the params are 16-bit (fp32 params are their own master). The distributed optimizer shards
the master and the moments over the d data-parallel ranks (the gradient buffer stays full-size:
ZeRO-1); it steps flat fp32 copies of its shard, so it keeps an fp32 master shard even for fp32
params. Bytes per parameter: bf16 or fp16 18, distributed ``6 + 12/d``; fp32 16, distributed
``8 + 12/d``. (Megatron's table differs in two rows: fp16 20 / ``4 + 16/d``, because its fp16 runs
keep fp16 gradients plus an fp32 copy, while here gradients are fp32 from the start; fp32
distributed ``8 + 8/d``, because Megatron's distributed optimizer steps fp32 params in place.)

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


def model_state_bytes_per_param(params_dtype: torch.dtype, distributed_optimizer: bool = False,
                                dp: int = 1) -> Fraction:
    """Bytes per parameter on one rank (module docstring)."""
    param, grad, optimizer = _state_parts(params_dtype, distributed_optimizer)
    return param + grad + Fraction(optimizer, dp if distributed_optimizer else 1)


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


def measured_model_state_bytes(chunks, optimizer) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}`` bytes held by this rank.

    ``chunks``: the DistributedDataParallel-wrapped model chunks (their ``grad_buffer`` is the
    gradient memory); ``optimizer``: the Megatron optimizer; its torch optimizer's parameters
    that are not model weights are the fp32 masters, and its state tensors the moments (the
    0-dim step counters are left out).
    """
    model = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    params = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    grads = sum(c.grad_buffer.numel() * c.grad_buffer.element_size() for c in chunks)
    inner = optimizer.optimizer
    opt = 0
    for group in inner.param_groups:
        for p in group["params"]:
            if p.untyped_storage().data_ptr() not in model:
                opt += p.numel() * p.element_size()
            for value in inner.state.get(p, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    opt += value.numel() * value.element_size()
    return {"params": params, "grads": grads, "optimizer": opt}
