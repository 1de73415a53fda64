"""LoRA adapters on the MoE experts' fc1 and fc2: one adapter per expert, sharded like the expert.

Every expert gets its own A and B (rank ``--lora-rank``), so expert parallelism holds each adapter
on the rank that holds its expert, and an adapter's gradient is reduced like its expert's (over the
expert-data-parallel group). Megatron-Bridge instead shares one adapter between the experts of a
layer by default; one per expert is what a Hugging Face PEFT adapter on per-expert linears is.

Sequential experts: ``local_experts.{j}.linear_fc{1,2}.adapter.linear_{in,out}.weight`` in the
dense layers' ``[rows, cols]`` layout. Grouped experts: stacked and transposed like ``weight1`` /
``weight2`` (``[E_local, in, out]``), ``linear_fc{1,2}_adapter.linear_{in,out}.weight``, computed with
the same grouped GEMM. Expert ``e`` draws its masters from the names
``mlp.experts.{e}.linear_fc{1,2}.adapter.linear_{in,out}.weight`` in both forms, so sequential and
grouped experts train identically. With expert tensor parallelism (the tensor-parallel group) A and
B are split as in :mod:`megatron_lite.lora.adapters`; fc2's adapter places its output slice into the
partial sum the dispatcher reduces over that group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import is_gated
from ..moe.experts import GroupedExperts, grouped_matmul
from ..parallel.random import EXPERT_RNG
from ..parallel.tensor import shard
from .adapters import _Weight, column_lora, lora_master, place_columns, row_lora


def _expert_shards(experts, config, lora, layer_number: int, expert: int, fc: str):
    """(A shard, B shard, A's partition dim, B's stride) of one expert's fc1 or fc2 adapter."""
    h, ffn, r = config.hidden_size, config.moe_ffn_hidden_size, lora.lora_rank
    rank, size = experts.etp_rank, experts.etp_size
    name = f"mlp.experts.{expert}.{fc}.adapter"
    if fc == "linear_fc1":
        rows, stride = (2 * ffn if is_gated(config) else ffn), (2 if is_gated(config) else 1)
        a = lora_master(config.seed, layer_number, f"{name}.linear_in.weight", r, h, False)
        b = lora_master(config.seed, layer_number, f"{name}.linear_out.weight", rows, r, True)
        return shard(a, 0, rank, size), shard(b, 0, rank, size, stride), 0, stride
    a = lora_master(config.seed, layer_number, f"{name}.linear_in.weight", r, ffn, False)
    b = lora_master(config.seed, layer_number, f"{name}.linear_out.weight", h, r, True)
    return shard(a, 1, rank, size), shard(b, 0, rank, size), 1, 1


class ExpertAdapter(nn.Module):
    """The adapter of one expert's fc1 or fc2 (sequential experts). ``forward(x)`` returns what is
    added to the expert GEMM's output (fc2: placed in the expert-tensor-parallel partial sum)."""

    def __init__(self, experts, fc: str, a, b, dims: tuple[int, int], stride: int, lora, hidden: int, tracker):
        super().__init__()
        self.kind = "column" if fc == "linear_fc1" else "row"
        self.group, self.hidden = experts.etp_group, hidden
        self.scale, self.dropout_p, self.tracker = lora.lora_alpha / lora.lora_rank, lora.lora_dropout, tracker
        self.linear_in = _Weight(self._param(experts, a, dims[0], 1))
        self.linear_out = _Weight(self._param(experts, b, dims[1], stride))

    def _param(self, experts, data, dim: int, stride: int) -> nn.Parameter:
        param = experts._param(data, dim)  # the expert's marks: is_expert, allreduce, its TP split
        if getattr(param, "tensor_model_parallel", False):
            param.partition_stride = stride
        param.lora = True
        return param

    def _dropout(self, x):
        if self.dropout_p == 0 or not self.training:
            return x
        if self.kind == "row" and self.group is not None:  # each expert-tensor rank drops its own slice
            with self.tracker.fork(EXPERT_RNG):
                return F.dropout(x, self.dropout_p, True)
        return F.dropout(x, self.dropout_p, True)

    def _adapt(self, x, matmul):
        a, b = self.linear_in.weight, self.linear_out.weight
        if self.kind == "column":
            return column_lora(self._dropout(x), a, b, self.group, matmul) * self.scale
        y = row_lora(self._dropout(x), a, b, self.group, matmul) * self.scale
        return place_columns(y, self.group, self.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._adapt(x, F.linear)


class GroupedExpertAdapter(ExpertAdapter):
    """The adapters of all local experts' fc1 or fc2, stacked ``[E_local, in, out]`` (grouped GEMM)."""

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        return self._adapt(x, lambda rows, w: grouped_matmul(rows, w, tokens_per_expert))


def add_expert_adapters(experts, config, lora, layer_number: int, targets, tracker) -> int:
    """Give ``experts`` (sequential or grouped) adapters on the fcs in ``targets``; returns how many fcs."""
    fcs = [fc for fc in ("linear_fc1", "linear_fc2") if fc in targets]
    first, n = experts.first_expert, experts.num_local_experts
    for fc in fcs:
        shards = [_expert_shards(experts, config, lora, layer_number, first + j, fc) for j in range(n)]
        if not shards:
            continue
        a_dim, stride = shards[0][2], shards[0][3]
        if isinstance(experts, GroupedExperts):  # [E_local, in, out]: a 2-D split dim d is dim 2 - d here
            a = torch.stack([s[0].t() for s in shards])
            b = torch.stack([s[1].t() for s in shards])
            adapter = GroupedExpertAdapter(experts, fc, a, b, (2 - a_dim, 2), stride, lora, config.hidden_size, tracker)
            setattr(experts, f"{fc}_adapter", adapter)
            continue
        for expert, (a, b, _, _) in zip(experts.local_experts, shards):
            adapter = ExpertAdapter(experts, fc, a, b, (a_dim, 0), stride, lora, config.hidden_size, tracker)
            getattr(expert, fc).adapter = adapter
    return len(fcs)
