"""Global gradient norm over every model-parallel rank, and clipping by it.

The norm must be the norm of the *whole* model's gradient, as if it lived in one process:

* a tensor-parallel shard is a distinct piece of the model: every TP rank counts its own shard;
* a replicated parameter (bias of a RowParallelLinear, norm weights) has the same gradient on
  every TP rank: only TP rank 0 counts it (:func:`megatron_lite.parallel.tensor.is_tp_duplicate`);
* with pipeline parallelism each stage holds different layers, except the tied word-embedding /
  output weight (attribute ``shared_embedding=True``), present on the first and last stage with
  the same (already summed) gradient: only the first stage counts it;
* expert parameters (``allreduce=False``) are sharded over the expert-parallel group too; on a
  folded expert grid (parallel folding) over its ETP x EP groups instead of TP: an expert shard
  counts on every rank of its ETP group (a whole one on ETP rank 0), and the expert sum runs over
  ETP, EP and PP, outside the TP x PP sum.

Squared norms are summed locally in fp32, expert ones over the expert-parallel group, then all
over the model-parallel (TP x PP) group (:func:`grad_norm_squared`, shared with the distributed
optimizer, which also sums over its shard group: data x context parallel, or one instance of it
with hybrid sharding; for expert parameters expert-data x context parallel, or one instance of it:
the other instances hold the same pieces, so each expert gradient counts once). Clipping scales
every gradient (duplicates included) by ``max_norm / (norm + 1e-6)`` when that is below 1, exactly
like ``torch.nn.utils.clip_grad_norm_``.
Gradients are read from ``param.main_grad`` when present (DistributedDataParallel), else ``.grad``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel import comm
from ..parallel.tensor import is_tp_duplicate


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer uses: the fp32 ``main_grad`` if the param has one, else ``.grad``."""
    g = getattr(param, "main_grad", None)
    return g if g is not None else param.grad


def counts_once(param: torch.Tensor, state) -> bool:
    """Whether this rank's copy of ``param`` contributes to global sums (norms, counts)."""
    if getattr(param, "is_expert", False) and getattr(state, "folded", False):  # split over ETP, not TP
        return getattr(param, "tensor_model_parallel", False) or state.etp_rank == 0
    if is_tp_duplicate(param, state.tp_rank):
        return False
    if getattr(param, "shared_embedding", False) and state.pp_size > 1 and not state.is_first_stage():
        return False
    return True


def grad_norm_squared(pairs, state, device, data_parallel: bool = False) -> torch.Tensor:
    """Squared L2 norm (fp32 scalar tensor on ``device``) of the whole model's gradient.

    ``pairs`` are ``(param, grad)``: ``param`` decides whether it counts (:func:`counts_once`) and
    whether it is an expert parameter (``allreduce=False``); ``grad`` (None = skip) is what is
    squared, e.g. a slice of the gradient when the optimizer state is sharded. With
    ``data_parallel`` each rank holds only part of the gradient, so the sums run over the
    data-parallel (x context-parallel) group too (the expert-data-parallel group for expert parameters).
    """
    return model_sum(pairs, state, device, sum_of_squares, data_parallel)


def model_sum(pairs, state, device, local_sum, data_parallel: bool = False) -> torch.Tensor:
    """``local_sum(tensors, device)`` (a scalar tensor) over the tensors of ``pairs`` that count once,
    summed over the ranks holding the rest of the model as :func:`grad_norm_squared` says."""
    grads = {True: [], False: []}  # dense (all-reduced over data parallelism) / expert gradients
    for p, g in pairs:
        if g is not None and counts_once(p, state):
            grads[getattr(p, "allreduce", True)].append(g.detach())
    dense, expert = (local_sum(grads[kind], device) for kind in (True, False))
    dense_groups = (state.dp_shard_group,) if data_parallel else ()  # sharded over DP x CP (/ instances)
    expert_groups = ((state.expert_dp_shard_group,) if data_parallel else ()) + (state.ep_group,)  # (/ instances)
    folded = getattr(state, "folded", False)  # experts over their own ETP x EP grid: summed over it and PP
    if folded:
        expert_groups += (state.etp_group, state.pp_group)
    for value, groups in ((dense, dense_groups), (expert, expert_groups)):
        for group in groups:
            if comm.group_size(group) > 1:
                dist.all_reduce(value, group=group)
    total = dense if folded else dense + expert
    if comm.group_size(state.mp_group) > 1:
        dist.all_reduce(total, group=state.mp_group)
    return total + expert if folded else total


def sum_of_squares(grads: list[torch.Tensor], device) -> torch.Tensor:
    """Sum of the squared L2 norms of ``grads`` in fp32: one multi-tensor norm (a few kernels for the
    whole model instead of two per parameter), no squared copies. Tensors on another device (an
    optimizer's host-offloaded masters) add their norms on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([n.to(device) for n in torch._foreach_norm(grads, 2, dtype=torch.float32)]).square().sum()


def count_zeros(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """How many entries of ``tensors`` are zero (a float64 scalar on ``device``: exact up to 2^53)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        total += (t.numel() - torch.count_nonzero(t)).to(device, torch.float64)
    return total


def get_grad_norm(params, state) -> float:
    """L2 norm of the gradient of the whole model (see the module docstring for what counts)."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    return math.sqrt(grad_norm_squared([(p, grad_of(p)) for p in params], state, device).item())


def clip_grad_norm(params, max_norm: float, state) -> float:
    """Scale all gradients so the global L2 norm is at most ``max_norm``; return the norm before clipping."""
    params = list(params)
    norm = get_grad_norm(params, state)
    coeff = max_norm / (norm + 1e-6)
    if coeff < 1.0:
        torch._foreach_mul_([g for g in map(grad_of, params) if g is not None], coeff)
    return norm
