"""Model-state bytes per parameter per rank: weights, gradient buffer, optimizer state.

This codebase keeps, per parameter: the weight in the params dtype (P bytes: 2 for bf16/fp16, 4
for fp32); an fp32 gradient buffer (``main_grad``, whatever the params dtype); AdamW's two fp32
moments; and an fp32 master copy when the params are 16-bit (fp32 params are their own master).
Every strategy but ``no_shard`` uses the distributed optimizer, which steps flat fp32 copies of its
shard, so it keeps an fp32 master shard even for fp32 params. Over d data-parallel ranks
(``--data-parallel-sharding-strategy``):

==================== ================= ========== ===========
strategy             formula           bf16/fp16  fp32
==================== ================= ========== ===========
no_shard             P + 4 + 8 (+4)    18         16
optim (ZeRO-1)       P + 4 + 12/d      6 + 12/d   8 + 12/d
optim_grads (ZeRO-2) P + 16/d          2 + 16/d   4 + 16/d
optim_grads_params   (P + 16)/d        18/d       20/d
==================== ================= ========== ===========

(The ``(+4)`` is the master of 16-bit params. Megatron's table differs in two rows: fp16 20 /
``4 + 16/d``, because its fp16 runs keep fp16 gradients plus an fp32 copy, while here gradients
are fp32 from the start; fp32 distributed ``8 + 8/d``, because Megatron's distributed optimizer
steps fp32 params in place.) Buckets are padded to a multiple of d; the formula is exact when
they need no padding. ZeRO-3's transiently gathered units and ZeRO-2/3's per-backward full
gradient buffers are activation-like and left out.

:func:`measured_model_state_bytes` counts what a built model and optimizer actually hold, for a
test to compare with the formula.
"""

from __future__ import annotations

from fractions import Fraction

import torch

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def model_state_bytes_per_param(params_dtype: torch.dtype, strategy: str = "no_shard", dp: int = 1) -> Fraction:
    """Bytes per parameter on one rank for ``strategy`` over ``dp`` ranks (module docstring)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"sharding strategy {strategy!r}: expected one of {STRATEGIES}")
    param = torch.empty((), dtype=params_dtype).element_size()
    if strategy == "no_shard":
        return Fraction(param + 4 + 8 + (4 if params_dtype != torch.float32 else 0))
    optimizer = Fraction(12, dp)  # fp32 master + two moments, sharded
    grads = Fraction(4, dp) if strategy in ("optim_grads", "optim_grads_params") else Fraction(4)
    weights = Fraction(param, dp) if strategy == "optim_grads_params" else Fraction(param)
    return weights + grads + optimizer


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a freed storage counts 0)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measured_model_state_bytes(chunks, optimizer) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}`` bytes held by this rank, from the tensors' storages.

    ``chunks``: the data-parallel wrapped model chunks. Params: the parameters' storages (a ZeRO-3
    parameter between uses has a freed, empty storage) plus each bucket's ``param_shard``. Grads:
    the full ``grad_buffer``, or the sharded ``grad_shards`` (plus any full bucket buffer alive at
    the time). ``optimizer``: the Megatron optimizer; its torch optimizer's parameters that are not
    model weights are the fp32 masters, and its state tensors the moments (the 0-dim step counters
    are left out).
    """
    buckets = [b for c in chunks for b in getattr(c, "buckets", [])]
    params = _storage_bytes([p for c in chunks for p in c.parameters()] + [b.param_shard for b in buckets])
    grads = _storage_bytes([getattr(c, "grad_buffer", None) for c in chunks] + [getattr(c, "grad_shards", None) for c in chunks]
                           + [b.data for b in buckets])
    model = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
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
