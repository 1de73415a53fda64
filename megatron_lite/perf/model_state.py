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

Frozen parameters (the base weights under LoRA) hold only their weight: P bytes each, no gradient,
no optimizer state, and no strategy shards them (ZeRO-3 included). A LoRA model with F frozen and T
adapter parameters therefore holds ``F x P + T x (the strategy's bytes)`` per rank
(:func:`model_state_bytes_with_frozen`); with T a fraction of a percent of F that is about P bytes
per base parameter, e.g. 2 for bf16 against 18 for a full fine-tune without sharding.

With the distributed optimizer, hybrid sharding over N instances (``--num-distributed-optimizer-
instances``) shards over d/N ranks only (every sharded row: with ZeRO-2/3 that is HSDP, e.g. fp32
ZeRO-3 ``20N/d``), and CPU offload of a fraction f of the shard
(``--optimizer-cpu-offload``) moves ``f x 12`` of its optimizer bytes to the host and adds a 4-byte
host gradient copy per offloaded element: bf16 ``optim`` device ``6 + (1-f) 12N/d``, host ``16fN/d``.
With ``--use-precision-aware-optimizer`` and bf16 moments (``--exp-avg-dtype bf16 --exp-avg-sq-dtype
bf16``) Adam's moments take 4 bytes instead of 8: the 12 of every sharded row becomes 8 (``optim``
bf16: ``6 + 8/d``).
Expert parameters (MoE) shard over the expert-data-parallel ranks instead: d/EP (and d/(EP x N)
with hybrid sharding, which cuts that group into the same N instances); TP x d / (ETP x EP) when the
experts have their own grid (parallel folding).

:func:`measured_model_state_bytes` counts what a built model and optimizer actually hold, for a
test to compare with the formula.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from ..moe.config import expert_grid_tp
from ..optim.precision_adam import moment_bytes
from ..parallel.data_parallel import SHARDING_STRATEGIES
from ..parallel.expert_grid import expert_dp_size


def _state_parts(params_dtype: torch.dtype, sharded_optimizer: bool, moments: int = 8) -> tuple[int, int, int]:
    """``(weight, gradient, optimizer)`` bytes per parameter before any sharding (``moments``: Adam's
    two moments together, 8 in fp32, 4 in bf16 with --use-precision-aware-optimizer)."""
    param = torch.empty((), dtype=params_dtype).element_size()
    separate_master = sharded_optimizer or params_dtype != torch.float32
    return param, 4, moments + (4 if separate_master else 0)  # moments (+ fp32 master)


def model_state_bytes_split(params_dtype: torch.dtype, strategy: str = "no_shard", dp: int = 1, *,
                            instances: int = 1, offload_fraction: float = 0.0,
                            moments: int = 8) -> tuple[Fraction, Fraction]:
    """(device, host) bytes per parameter on one rank for ``strategy`` (module docstring).

    ``dp`` is the size of the group the sharded strategies shard over without hybrid sharding
    (data x context parallel); with ``instances`` they shard over ``dp / instances`` ranks only.
    ``offload_fraction`` of the optimizer shard keeps master and moments on the host, plus a host
    copy of its gradient.
    """
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding strategy {strategy!r}: expected one of {SHARDING_STRATEGIES}")
    param, grad, optimizer = _state_parts(params_dtype, strategy != "no_shard", moments)
    if strategy == "no_shard":
        return Fraction(param + grad + optimizer), Fraction(0)
    shard = Fraction(dp, instances)
    offloaded = Fraction(str(offload_fraction))
    weights = param / shard if strategy == "optim_grads_params" else Fraction(param)
    grads = grad / shard if strategy != "optim" else Fraction(grad)
    return weights + grads + optimizer * (1 - offloaded) / shard, (optimizer + grad) * offloaded / shard


def model_state_bytes_per_param(params_dtype: torch.dtype, strategy: str = "no_shard", dp: int = 1, *,
                                instances: int = 1, offload_fraction: float = 0.0, moments: int = 8) -> Fraction:
    """Bytes per parameter on one rank, device and host together (module docstring)."""
    device, host = model_state_bytes_split(params_dtype, strategy, dp, instances=instances,
                                           offload_fraction=offload_fraction, moments=moments)
    return device + host


def model_state_bytes_with_frozen(params_dtype: torch.dtype, strategy: str = "no_shard", dp: int = 1, *,
                                  frozen: int, trainable: int, instances: int = 1,
                                  offload_fraction: float = 0.0, moments: int = 8) -> tuple[Fraction, Fraction]:
    """(device, host) bytes on one rank of a model with ``frozen`` parameters (weights only, never
    sharded) and ``trainable`` ones (the strategy's bytes each, :func:`model_state_bytes_split`)."""
    device, host = model_state_bytes_split(params_dtype, strategy, dp, instances=instances,
                                           offload_fraction=offload_fraction, moments=moments)
    weight = torch.empty((), dtype=params_dtype).element_size()
    return frozen * weight + trainable * device, trainable * host


def _storage_bytes(tensors, skip=frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage once; a
    freed storage counts 0; storages in ``skip`` are left out)."""
    sizes = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in skip:
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def model_state_tensors(chunks, optimizer) -> dict[str, list[torch.Tensor]]:
    """The tensors behind each part of the model state, ``{"params", "grads", "optimizer", "optimizer_cpu"}``.

    ``chunks``: the data-parallel wrapped model chunks (or plain modules). Params: the parameters (a ZeRO-3 parameter
    is a view of its bucket's gathered buffer, freed between uses) plus each bucket's
    ``param_shard``. Grads: the full ``grad_buffer``, or the sharded ``grad_shards`` (plus any full
    bucket buffer alive at the time). ``optimizer``: the Megatron optimizer (or a torch one); its torch optimizer's
    parameters that are not model weights are the fp32 masters, and its state tensors the moments
    (the 0-dim step counters are left out); with optimizer CPU offload the host half's masters,
    moments and gradient copy are ``optimizer_cpu``. A tensor sharing a model weight's or a host
    tensor's storage is not repeated under ``optimizer``.
    """
    buckets = [b for c in chunks for b in getattr(c, "buckets", [])]
    model = [p for c in chunks for p in c.parameters()]
    inner = getattr(optimizer, "optimizer", optimizer)
    host = list(inner.host_tensors()) if hasattr(inner, "host_tensors") else []
    skip = {t.untyped_storage().data_ptr() for t in model + host}
    tensors = []
    for group in inner.param_groups:
        for p in group["params"]:
            tensors.append(p)
            tensors += [v for v in inner.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
    grads = ([getattr(c, "grad_buffer", None) for c in chunks] + [getattr(c, "grad_shards", None) for c in chunks]
             + [b.data for b in buckets])
    return {
        "params": model + [b.param_shard for b in buckets if b.param_shard is not None],
        "grads": [g for g in grads if g is not None],
        "optimizer": [t for t in tensors if t.untyped_storage().data_ptr() not in skip],
        "optimizer_cpu": host,
    }


def measured_model_state_bytes(chunks, optimizer) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "optimizer_cpu"}`` bytes held by this rank, from the storages of
    :func:`model_state_tensors` (a view counts its whole storage once, a freed storage 0)."""
    return {part: _storage_bytes(tensors) for part, tensors in model_state_tensors(chunks, optimizer).items()}


def expert_data_parallel_size(config, dp_cp: int) -> int:
    """The ranks holding the same expert shard: DP x CP / EP, or TP x CP x DP / (ETP x EP) when the
    experts have their own grid (parallel folding: megatron_lite/parallel/expert_grid.py)."""
    p = config.parallel
    tp, cp, ep = p.tensor_model_parallel_size, p.context_parallel_size, p.expert_model_parallel_size
    return expert_dp_size(tp, cp, dp_cp // cp, ep, expert_grid_tp(config))


def formula_model_state_bytes(config, chunks, dp_cp: int) -> tuple[Fraction, Fraction]:
    """(device, host) bytes the formula gives this rank for the run's flags and parameters: frozen
    ones hold their weight, dense ones shard over ``dp_cp`` (data x context parallel, without hybrid
    sharding), expert ones (``allreduce=False``) over the expert-data-parallel ranks ``dp_cp / EP``;
    both over one of the ``--num-distributed-optimizer-instances``."""
    p, o = config.parallel, config.optim
    strategy, dtype = p.data_parallel_sharding_strategy, config.precision.params_dtype
    kw = dict(instances=p.num_distributed_optimizer_instances,
              offload_fraction=o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0,
              moments=moment_bytes(config.precision) if o.optimizer == "adam" else 8)
    params = [q for c in chunks for q in c.parameters()]
    frozen = sum(q.numel() for q in params if not q.requires_grad)
    expert = sum(q.numel() for q in params if q.requires_grad and not getattr(q, "allreduce", True))
    dense = sum(q.numel() for q in params) - frozen - expert
    device, host = model_state_bytes_with_frozen(dtype, strategy, dp_cp, frozen=frozen, trainable=dense, **kw)
    if expert:
        e_device, e_host = model_state_bytes_split(dtype, strategy, expert_data_parallel_size(config, dp_cp), **kw)
        device, host = device + expert * e_device, host + expert * e_host
    return device, host


def model_state_report(config, chunks, optimizer, dp_cp: int) -> str:
    """One line: the bytes per parameter this rank holds (measured) next to the formula for the
    run's data-parallel sharding strategy (:func:`formula_model_state_bytes`); ``dp_cp`` is the size
    of the group the optimizer shards over without hybrid sharding (data x context parallel)."""
    p, o = config.parallel, config.optim
    instances = p.num_distributed_optimizer_instances
    fraction = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    params = [q for c in chunks for q in c.parameters()]
    n = sum(q.numel() for q in params)
    frozen = sum(q.numel() for q in params if not q.requires_grad)
    expert = sum(q.numel() for q in params if q.requires_grad and not getattr(q, "allreduce", True))
    per = {k: v / max(n, 1) for k, v in measured_model_state_bytes(chunks, optimizer).items()}
    line = (f"model state on this rank, bytes per parameter ({n:,} params): params {per['params']:.2f} + grads "
            f"{per['grads']:.2f} + optimizer {per['optimizer']:.2f} = device "
            f"{per['params'] + per['grads'] + per['optimizer']:.2f}; optimizer on CPU {per['optimizer_cpu']:.2f}")
    device, host = (v / max(n, 1) for v in formula_model_state_bytes(config, chunks, dp_cp))
    what = f", {frozen:,} of them frozen" if frozen else ""
    what += f", {expert:,} expert params at d={expert_data_parallel_size(config, dp_cp)}" if expert else ""
    return (line + f" | formula for {p.data_parallel_sharding_strategy} (d={dp_cp}, instances {instances}, "
            f"offload {fraction:g}{what}): device {float(device):.2f}, CPU {float(host):.2f}")
