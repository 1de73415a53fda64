"""LoRA adapters sharded like the parallel linear they adapt: ``y = W x + (alpha / r) B A dropout(x)``.

``A`` (``linear_in``, ``[r, in]``) and ``B`` (``linear_out``, ``[out, r]``) are split over the
tensor-parallel group the way their base layer is (Megatron-Bridge's ``ParallelLinearAdapter``):

* **column-parallel base** (``linear_qkv``, ``linear_fc1``): A's *rank* is split (``[r/tp, in]``) and
  its output all-gathered to the full ``r``; B is split like the base output (``[out/tp, r]``, with
  the base's partition stride, e.g. SwiGLU's ``[gate; up]``). The adapter reads the input the base
  GEMM reads - under sequence parallelism the already all-gathered sequence, whose backward
  reduce-scatter also sums the adapter's partial input gradients - so it adds no sequence gather.
* **row-parallel base** (``linear_proj``, ``linear_fc2``): A is split like the base input
  (``[r, in/tp]``), its partial products all-reduced; B's output is split (``[out/tp, r]``) and
  all-gathered, then (sequence parallelism) cut back to this rank's part of the sequence.

In both, the full ``r``-wide activation between A and B enters B through ``copy_to_tp`` (identity
forward, all-reduce backward): each rank's B shard gives a partial gradient of it. The same two
functions serve the MoE experts over their expert-tensor-parallel group (``None``: nothing split),
with a grouped GEMM for stacked experts; there a row adapter's output slice is placed into the
partial sum the token dispatcher reduces.

Weights are seeded by name like every other parameter (:mod:`megatron_lite.models.common`): A is
drawn from the full ``[r, in]`` master with Xavier-normal init (Megatron-Bridge's ``xavier``), B is
zero, so a fresh adapter changes nothing. Dropout (``--lora-dropout``, on the adapter's input) uses
the default stream when the input is the same on every tensor-parallel rank and the tensor-parallel
stream of the RNG tracker when each rank holds a different slice of it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..models.common import param_generator
from ..parallel import comm
from ..parallel.tensor import shard


def column_lora(x, a, b, group, matmul=F.linear):
    """Column-parallel base: ``x`` full (gathered) input, ``a`` ``[r/tp, in]``, ``b`` ``[out/tp, r]`` ->
    this rank's output columns ``[..., out/tp]`` (unscaled)."""
    z = comm.gather_from_tp(matmul(x, a), group)
    return matmul(comm.copy_to_tp(z, group), b)


def row_lora(x, a, b, group, matmul=F.linear):
    """Row-parallel base: ``x`` this rank's input slice, ``a`` ``[r, in/tp]``, ``b`` ``[out/tp, r]`` ->
    this rank's output columns ``[..., out/tp]`` of the full (not partial) adapter output (unscaled)."""
    z = comm.reduce_from_tp(matmul(x, a), group)
    return matmul(comm.copy_to_tp(z, group), b)


def lora_master(seed: int, layer_number: int, name: str, rows: int, cols: int, zero: bool) -> torch.Tensor:
    """The full fp32 master of adapter weight ``name`` (``...adapter.linear_in.weight``): Xavier-normal
    from its own seeded generator, or zeros (B)."""
    master = torch.zeros(rows, cols)
    if not zero:
        std = math.sqrt(2.0 / (rows + cols))
        master.normal_(0.0, std, generator=param_generator(seed, layer_number, name))
    return master


def mark(param: nn.Parameter, partition_dim: int | None, stride: int = 1) -> nn.Parameter:
    """Flag an adapter weight (``lora``) and, when split over tensor parallelism, how."""
    param.lora = True
    if partition_dim is not None:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, partition_dim, stride
    return param


class _Weight(nn.Module):
    """Holds one adapter matrix as ``weight`` (so names read ``adapter.linear_in.weight``)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class LinearAdapter(nn.Module):
    """The adapter of one Column/RowParallelLinear: ``adapter.linear_in.weight`` (A) and
    ``adapter.linear_out.weight`` (B), this rank's shards. ``forward(x)`` takes the input the base
    GEMM takes and returns what is added to the base output (same layout, bias excluded)."""

    def __init__(self, base, kind: str, config, lora, layer_number: int, name: str, tracker):
        super().__init__()
        self.kind, self.group = kind, base.tp_group
        self.scale, self.dropout_p, self.tracker = lora.lora_alpha / lora.lora_rank, lora.lora_dropout, tracker
        self.sequence_parallel = base.sequence_parallel
        size, rank = comm.group_size(self.group), comm.group_rank(self.group)
        r, dtype = lora.lora_rank, base.weight.dtype
        a = lora_master(config.seed, layer_number, f"{name}.adapter.linear_in.weight", r, base.input_size, False)
        b = lora_master(config.seed, layer_number, f"{name}.adapter.linear_out.weight", base.output_size, r, True)
        stride = int(getattr(base.weight, "partition_stride", 1))
        a_dim = 0 if kind == "column" else 1
        self.linear_in = _Weight(mark(nn.Parameter(shard(a, a_dim, rank, size).to(dtype)), a_dim))
        self.linear_out = _Weight(mark(nn.Parameter(shard(b, 0, rank, size, stride).to(dtype)), 0, stride))

    def _dropout(self, x):
        if self.dropout_p == 0 or not self.training:
            return x
        if self.kind == "row" and comm.group_size(self.group) > 1:  # each rank drops its own slice
            with self.tracker.fork():
                return F.dropout(x, self.dropout_p, True)
        return F.dropout(x, self.dropout_p, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.linear_in.weight, self.linear_out.weight
        if self.kind == "column":
            return column_lora(self._dropout(x), a, b, self.group) * self.scale
        y = comm.gather_from_tp(row_lora(self._dropout(x), a, b, self.group), self.group) * self.scale
        return comm.scatter_to_sp(y, self.group) if self.sequence_parallel else y


def place_columns(y: torch.Tensor, group, full: int) -> torch.Tensor:
    """This rank's output columns ``y`` inside zeros of width ``full``: its share of a partial sum
    that is reduced over ``group`` later (the MoE dispatcher's expert-tensor-parallel reduction)."""
    size = comm.group_size(group)
    if size == 1:
        return y
    left = comm.group_rank(group) * y.shape[-1]
    return F.pad(y, (left, full - left - y.shape[-1]))
