"""Autograd collectives: every byte that crosses a process boundary in the model goes through here.

Names follow Megatron's operators. The tensor-parallel (TP) ones work on the last (hidden) dim:

====================  ===========================  ===========================
function              forward                      backward
====================  ===========================  ===========================
copy_to_tp  (``f``)    identity                     all-reduce
reduce_from_tp (``g``) all-reduce                   identity
scatter_to_tp          keep my slice of last dim    all-gather last dim
gather_from_tp         all-gather last dim          keep my slice
====================  ===========================  ===========================

The sequence-parallel (SP) ones work on dim 0 (activations are ``[seq, batch, hidden]``):
``scatter_to_sp`` (split / all-gather), ``gather_from_sp`` (all-gather / reduce-scatter, or split
when the consumer is not tensor-parallel), ``reduce_scatter_to_sp`` (reduce-scatter / all-gather).
``all_to_all`` exchanges uneven chunks along dim 0 for expert parallelism.

A ``group`` of ``None`` means a group of one rank: every function is then the identity.
Under ``--torch-compile`` every collective here runs eagerly, a graph break in the compiled layer
(one with a ``None`` group is the identity and does not break the graph).

Every primitive reports the bytes it sends to :func:`megatron_lite.perf.comm_volume.record`
(kind ``tp`` for the tensor-parallel operators, ``sp`` for the sequence-parallel ones, ``ep`` for
the all-to-all; the sequence and all-to-all operators take a ``kind`` argument, so context
parallelism counts its traffic as ``cp`` and the MoE dispatchers theirs as ``ep``); that is free
unless a counter is active (``--log-comm-volume``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..perf.comm_volume import record, tensor_bytes

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ---------------------------------------------------------------------------------------------
# Plain (non-autograd) primitives.


def _all_reduce(x: torch.Tensor, group, kind: str = "tp") -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    record(kind, "all_reduce", tensor_bytes(x), group_size(group))
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {size}")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group, kind: str = "tp") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (gathered along dim 0, the contiguous case)."""
    size = group_size(group)
    if size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous() if dim != 0 else x.contiguous()
    out = torch.empty((size * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    record(kind, "all_gather", tensor_bytes(out), size)
    all_gather_single(out, moved, group=group)
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def _reduce_scatter(x: torch.Tensor, group, kind: str = "sp") -> torch.Tensor:
    """Sum over the group, each rank keeping its chunk of dim 0."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by the group size {size}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    record(kind, "reduce_scatter", tensor_bytes(x), size)
    reduce_scatter_single(out, x, group=group)
    return out


_apply_outside_compile = None  # set by break_graph_at_collectives()


def break_graph_at_collectives() -> None:
    """``--torch-compile``: from now on each collective below runs eagerly, a clean graph break inside
    compiled regions (they are autograd functions around ``torch.distributed`` calls). Set only when
    compiling, so plain runs never import Dynamo."""
    global _apply_outside_compile
    _apply_outside_compile = torch.compiler.disable(lambda fn, *args: fn.apply(*args))


def _eager(fn, *args):
    """Apply the autograd collective ``fn`` (outside any compiled graph once compiling is configured)."""
    if _apply_outside_compile is not None:
        return _apply_outside_compile(fn, *args)
    return fn.apply(*args)


# ---------------------------------------------------------------------------------------------
# Tensor-parallel region operators (last dimension).


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone() if group_size(group) > 1 else x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, grad.dim() - 1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


def copy_to_tp(x, group):
    """``f``: identity forward, all-reduce of the gradient backward (enters a TP region)."""
    return x if group is None else _eager(_CopyToTP, x, group)


def reduce_from_tp(x, group):
    """``g``: all-reduce forward, identity backward (leaves a TP region)."""
    return x if group is None else _eager(_ReduceFromTP, x, group)


def scatter_to_tp(x, group):
    """Keep this rank's slice of the last dim; the gradient is all-gathered."""
    return x if group is None else _eager(_ScatterToTP, x, group)


def gather_from_tp(x, group):
    """All-gather along the last dim; the gradient is split back."""
    return x if group is None else _eager(_GatherFromTP, x, group)


# ---------------------------------------------------------------------------------------------
# Sequence-parallel operators (dim 0).


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 0, ctx.group, "sp"), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tp_output_grad, kind):
        ctx.group, ctx.tp_output_grad, ctx.kind = group, tp_output_grad, kind
        return _all_gather(x, 0, group, kind)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_output_grad:  # each rank holds a partial gradient of the full sequence: sum + split
            return _reduce_scatter(grad, ctx.group, ctx.kind), None, None, None
        return _split(grad, 0, ctx.group), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return _reduce_scatter(x, group, kind)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 0, ctx.group, ctx.kind), None, None


def scatter_to_sp(x, group):
    """Keep this rank's chunk of the sequence (dim 0); the gradient is all-gathered."""
    return x if group is None else _eager(_ScatterToSP, x, group)


def gather_from_sp(x, group, tensor_parallel_output_grad: bool = True, kind: str = "sp"):
    """All-gather the sequence (dim 0).

    Backward reduce-scatters when the gathered tensor feeds tensor-parallel compute (each rank then
    holds a partial gradient of the whole sequence), else just keeps this rank's chunk. ``kind``
    is the group kind the bytes are counted under (the same operator serves CP and EP).
    """
    return x if group is None else _eager(_GatherFromSP, x, group, tensor_parallel_output_grad, kind)


def reduce_scatter_to_sp(x, group, kind: str = "sp"):
    """Sum partial results over TP and keep this rank's chunk of the sequence; backward all-gathers."""
    return x if group is None else _eager(_ReduceScatterToSP, x, group, kind)


# ---------------------------------------------------------------------------------------------
# All-to-all for expert parallelism.


def _all_to_all_raw(x, output_splits, input_splits, group, kind):
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    rows = sum(output_splits) if output_splits is not None else x.shape[0]
    out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    mine = (input_splits[group_rank(group)] if input_splits is not None else x.shape[0] // group_size(group))
    record(kind, "all_to_all", (x.shape[0] - mine) * tensor_bytes(x[:1]) if x.shape[0] else 0, group_size(group))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, kind):
        ctx.group, ctx.output_splits, ctx.input_splits, ctx.kind = group, output_splits, input_splits, kind
        return _all_to_all_raw(x, output_splits, input_splits, group, kind)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_raw(grad, ctx.input_splits, ctx.output_splits, ctx.group, ctx.kind), None, None, None, None


def all_to_all(x, group, output_splits=None, input_splits=None, kind: str = "ep"):
    """Send ``input_splits[i]`` rows of ``x`` (dim 0) to rank i, receive ``output_splits[i]`` from it.

    Splits are lists of ints (``None``: equal chunks). Backward runs the reverse exchange. ``kind``:
    the group kind its bytes are counted under (``ep`` for MoE tokens, ``cp`` for Ulysses attention).
    """
    return x if group is None else _eager(_AllToAll, x, output_splits, input_splits, group, kind)
