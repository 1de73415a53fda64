"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Each layer holds only its shard of the weight. Weights are initialised by filling the *full*
("master") weight with ``init_method`` and slicing this rank's part, so the model is the same at
any tensor-parallel size. Sharded parameters carry ``tensor_model_parallel = True`` with their
``partition_dim`` and ``partition_stride``; replicated parameters that only see a sequence shard
under sequence parallelism carry ``sequence_parallel = True``, and their gradients must be
all-reduced over the TP group (:func:`all_reduce_sequence_parallel_grads`).

The GEMM seam: both linear layers compute their local product with ``self.gemm(x, weight, bias)``,
:func:`linear_gemm` (``F.linear``) unless a precision recipe passes another function with the same
signature (e.g. an FP8 GEMM). It runs on this rank's shard: after the input's all-gather / copy
into the TP region, before the partial sums are reduced. A ``gemm`` that is an ``nn.Module`` is a
submodule, so its state (scaling history) is saved with the layer. With
``gradient_accumulation_fusion`` and no other GEMM, the layer uses
:func:`~megatron_lite.parallel.grad_accumulation.accumulating_linear_gemm`, whose backward adds the
weight gradient straight into ``main_grad`` (a weight passed in with ``weight=``, a tied embedding,
is not marked ready there: its lookup's gradient, which comes later, does that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .grad_accumulation import (
    accumulates_lookup,
    accumulating_embedding,
    accumulating_linear_gemm,
    accumulating_linear_gemm_not_last,
)

InitMethod = Callable[[torch.Tensor], None]
Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def linear_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The default GEMM of the parallel linear layers: ``x @ weight^T + bias``."""
    return F.linear(x, weight, bias)


DEFAULT_GEMMS = (linear_gemm, accumulating_linear_gemm)  # the plain GEMMs (a precision recipe's is not one)


def default_gemm(gradient_accumulation_fusion: bool) -> Gemm:
    return accumulating_linear_gemm if gradient_accumulation_fusion else linear_gemm


def normal_init(std: float, generator: torch.Generator | None = None) -> InitMethod:
    """``init_method`` drawing N(0, std^2), optionally from its own seeded generator."""

    def init(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            tensor.normal_(0.0, std, generator=generator)

    return init


DEFAULT_INIT = normal_init(0.02)


def xavier_uniform_init(generator: torch.Generator | None = None) -> InitMethod:
    """``init_method`` drawing Xavier's U(-a, a), a = sqrt(6 / (fan_in + fan_out)) of the tensor it fills
    (the whole master weight, so the same at any TP size)."""

    def init(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            torch.nn.init.xavier_uniform_(tensor, generator=generator)

    return init


def scaled_normal_init(std: float, num_layers: int, generator: torch.Generator | None = None) -> InitMethod:
    """Megatron's output-layer init: std / sqrt(2 * num_layers)."""
    return normal_init(std / math.sqrt(2.0 * num_layers), generator)


def shard(master: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """This rank's part of a full tensor.

    With ``stride`` s the dimension is first cut into s equal blocks (e.g. the gate and up halves
    of a fused SwiGLU weight) and each block is chunked over the ranks, so every rank gets its
    part of every block.
    """
    blocks = master.chunk(stride, dim=dim)
    if any(b.shape[dim] % size for b in blocks):
        raise ValueError(f"size {master.shape[dim]} of dim {dim} is not divisible by {size} x stride {stride}")
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard` given every rank's part in rank order."""
    per_rank = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[b] for p in per_rank], dim=dim) for b in range(stride)], dim=dim)


def _init_shard(param: nn.Parameter, full_shape, init_method, dim, rank, size, stride) -> None:
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        param.copy_(shard(master, dim, rank, size, stride))
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride


def _divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what} {total} is not divisible by --tensor-model-parallel-size {size} (the size of this "
                         f"layer's tensor-parallel group)")
    return total // size


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp_size: int = 1) -> int:
    """Round the vocabulary up to a multiple of ``make-vocab-size-divisible-by x TP``."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (output features) over the TP group.

    Input is replicated over TP (with sequence parallelism: this rank's sequence chunk, which is
    all-gathered first). Output is this rank's slice of the features, or the full output with
    ``gather_output``. ``skip_bias_add`` returns ``(output, bias)`` so the caller can fuse the add.
    With ``skip_weight_param_allocation`` the layer owns no weight and ``forward`` takes it as
    ``weight=`` (a tied output layer computing with the word embedding's shard).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp_group=None,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init_method: InitMethod = DEFAULT_INIT,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        stride: int = 1,
        skip_weight_param_allocation: bool = False,
        gemm: Gemm | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
        gradient_accumulation_fusion: bool = False,
    ):
        super().__init__()
        self.tp_group = tp_group
        size, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(output_size, size, "ColumnParallelLinear's output size")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and size > 1
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output cannot be combined with sequence parallelism")
        self.gemm = gemm if gemm is not None else default_gemm(gradient_accumulation_fusion)
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, device=device, dtype=dtype))
            _init_shard(self.weight, (output_size, input_size), init_method, 0, rank, size, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, device=device, dtype=dtype))
            self.bias.tensor_model_parallel, self.bias.partition_dim = True, 0
            self.bias.partition_stride = stride
        else:
            self.register_parameter("bias", None)
        self.adapter = None  # a LoRA adapter (megatron_lite/lora) adds adapter(x) to the output

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, *, last_use: bool = True):
        """``last_use=False``: the weight is used again in this forward by a call whose gradient backward
        reaches later (the main output head read again by multi-token prediction heads); only the last
        gradient marks the weight ready for gradient-accumulation fusion."""
        if weight is None:
            if self.weight is None:
                raise ValueError("this ColumnParallelLinear owns no weight (skip_weight_param_allocation); pass weight=")
            weight = self.weight
        gemm = self.gemm
        if (weight is not self.weight or not last_use) and gemm is accumulating_linear_gemm:
            gemm = accumulating_linear_gemm_not_last  # a tied embedding: its lookup's gradient comes later
        if self.sequence_parallel:
            x = comm.gather_from_sp(x, self.tp_group, tensor_parallel_output_grad=True)
        else:
            x = comm.copy_to_tp(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        out = gemm(x, weight, bias)
        if self.adapter is not None:  # reads the same (gathered) input as the GEMM
            out = out + self.adapter(x)
        if self.gather_output:
            out = comm.gather_from_tp(out, self.tp_group)
        return (out, self.bias) if self.skip_bias_add else out


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (input features) over the TP group.

    Input is this rank's slice of the features (``input_is_parallel``) or the full input, which is
    then split. Partial products are summed by an all-reduce, or by a reduce-scatter along the
    sequence under sequence parallelism. The bias is replicated and added after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp_group=None,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_method: InitMethod = DEFAULT_INIT,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        gemm: Gemm | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
        gradient_accumulation_fusion: bool = False,
    ):
        super().__init__()
        self.tp_group = tp_group
        size, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, size, "RowParallelLinear's input size")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel and size > 1
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence parallelism needs input_is_parallel=True")
        self.gemm = gemm if gemm is not None else default_gemm(gradient_accumulation_fusion)
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition, device=device, dtype=dtype))
        _init_shard(self.weight, (output_size, input_size), init_method, 1, rank, size, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, device=device, dtype=dtype))
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self.adapter = None  # a LoRA adapter (megatron_lite/lora) adds adapter(x) to the reduced output

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, self.tp_group)
        partial = self.gemm(x, self.weight, None)
        if self.sequence_parallel:
            out = comm.reduce_scatter_to_sp(partial, self.tp_group)
        else:
            out = comm.reduce_from_tp(partial, self.tp_group)
        if self.adapter is not None:
            out = out + self.adapter(x)
        if self.skip_bias_add:
            return out, self.bias
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over the TP group.

    Each rank looks up the ids in its vocab range (others give zeros), then the partial results
    are summed: an all-reduce, or under sequence parallelism a reduce-scatter along dim 0 (pass
    ids as ``[seq, batch]``). With ``gradient_accumulation_fusion`` the lookup's gradient rows go
    straight into the weight's ``main_grad`` on a CPU
    (:func:`~megatron_lite.parallel.grad_accumulation.accumulating_embedding`): only for a table whose
    one lookup per forward is this one.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_group=None,
        *,
        init_method: InitMethod = DEFAULT_INIT,
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
        gradient_accumulation_fusion: bool = False,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        size, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = _divide(num_embeddings, size, "padded vocabulary size")
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.sequence_parallel = sequence_parallel and size > 1
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        _init_shard(self.weight, (num_embeddings, embedding_dim), init_method, 0, rank, size, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lookup = (accumulating_embedding if self.gradient_accumulation_fusion and accumulates_lookup(self.weight)
                  else F.embedding)
        if comm.group_size(self.tp_group) > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = lookup(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = lookup(ids, self.weight)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(out, self.tp_group)
        return comm.reduce_from_tp(out, self.tp_group)


def all_reduce_sequence_parallel_grads(params: Iterable[nn.Parameter], tp_group) -> None:
    """Sum over TP the gradients of replicated parameters that each rank saw only a sequence shard of."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or comm.group_size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.record("sp", "all_reduce", comm.tensor_bytes(flat), comm.group_size(tp_group))
    torch.distributed.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def is_tp_duplicate(param: nn.Parameter, tp_rank: int) -> bool:
    """True for a replicated parameter on a TP rank other than 0 (count it once, e.g. for norms)."""
    return not getattr(param, "tensor_model_parallel", False) and tp_rank != 0
