"""Token dispatchers: bring each token to the ranks holding its experts and the results back.

Both dispatchers implement ``run(hidden [T, h], probs [T, E], routing_map [T, E], experts) -> [T, h]``
as ``dispatch`` (tokens grouped by local expert, with their routing weight and the per-expert
row counts), the experts, then ``combine`` (every token's expert outputs summed back in place).
All communication goes through the autograd collectives of :mod:`megatron_lite.parallel.comm`,
so both are exact under autograd. The local experts of expert-parallel rank j are the global
experts ``[j * E_l, (j + 1) * E_l)``; the expert-tensor-parallel (ETP) group is the
tensor-parallel group.

* :class:`AllToAllDispatcher`: permute the local tokens expert-major, uneven all-to-all over the
  EP group, (ETP > 1: all-gather-v over ETP), regroup the received chunks from (source rank,
  local expert) to (local expert, source rank), experts, and the exact inverse of each step
  (ETP > 1: reduce-scatter-v sums the partial outputs), then an un-weighted scatter-add.
* :class:`AllGatherDispatcher`: all-gather tokens, weights and map over TP then EP, keep the
  columns of the local experts, experts, scatter-add, reduce-scatter over EP then TP.
"""

from __future__ import annotations

import torch

from ..parallel import comm
from .experts import expert_tp_group
from .routing import pad_routing_map


def all_gather_v(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``x`` (rank r has ``sizes[r]`` rows) along dim 0, under autograd.

    Built from the uneven all-to-all (each rank sends its whole ``x`` to every rank), so the
    backward is the matching reduce-scatter-v.
    """
    n = comm.group_size(group)
    if n == 1:
        return x
    copies = x.repeat(n, *([1] * (x.dim() - 1)))
    return comm.all_to_all(copies, group, output_splits=sizes, input_splits=[x.shape[0]] * n, kind="ep")


def reduce_scatter_v(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Sum ``x`` (blocks of ``sizes[r]`` rows, one per rank) over the group and keep this rank's block."""
    n = comm.group_size(group)
    if n == 1:
        return x
    mine = sizes[comm.group_rank(group)]
    received = comm.all_to_all(x, group, output_splits=[mine] * n, input_splits=sizes, kind="ep")
    return received.view(n, mine, *x.shape[1:]).sum(dim=0)


def _gather_counts(counts: torch.Tensor, *groups) -> torch.Tensor:
    """All-gather a metadata vector over each group in turn: ``[size of last group, ..., size of first, n]``
    flattened to rows (no gradient)."""
    rows = counts.unsqueeze(0)
    with torch.no_grad():
        for group in groups:
            rows = comm.gather_from_sp(rows, group, kind="ep")
    return rows


def _chunk_order(sizes: torch.Tensor) -> torch.Tensor:
    """Row index regrouping chunks laid out ``[R, E_l]`` (row-major) into ``[E_l, R]`` order."""
    rows, experts = sizes.shape
    flat = sizes.reshape(-1)
    starts = flat.cumsum(0) - flat
    order = torch.arange(rows * experts).view(rows, experts).t().reshape(-1)
    sel_sizes, sel_starts = flat[order], starts[order]
    total = int(sel_sizes.sum())
    offsets = torch.repeat_interleave(sel_sizes.cumsum(0) - sel_sizes, sel_sizes)
    return torch.repeat_interleave(sel_starts, sel_sizes) + torch.arange(total) - offsets


def permute(hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """Rows grouped expert-major (each expert's tokens in ascending order) with their weights.
    Returns ``(rows, weights, token_index)``; ``token_index`` is what :func:`unpermute` needs."""
    expert_index, token_index = routing_map.t().nonzero(as_tuple=True)
    return hidden.index_select(0, token_index), probs[token_index, expert_index], token_index


def permute_padded(hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, multiple: int):
    """:func:`permute` with each expert's row count padded to a multiple of ``multiple``
    (:func:`~megatron_lite.moe.routing.pad_routing_map`). An expert's routed tokens come first, in
    ascending order as in :func:`permute`, then its padding slots, whose rows are zero and whose
    weight is 0: they change no FP8 amax and add nothing to any output or gradient. Returns
    ``(rows, weights, token_index, keep [N, 1], padded_map)``; ``keep`` is 1 for a routed row, 0 for
    padding, and zeroes the padding rows' outputs in the combine (so their output gradient is zero too)."""
    padded = pad_routing_map(routing_map, multiple)
    slots = torch.stack([routing_map.t(), padded.t() & ~routing_map.t()], dim=1)  # [E, 2, T]: routed, padding
    expert_index, is_pad, token_index = slots.nonzero(as_tuple=True)
    keep = (is_pad == 0).unsqueeze(1)
    rows = hidden.index_select(0, token_index) * keep.to(hidden.dtype)
    weights = probs[token_index, expert_index] * keep.squeeze(1).to(probs.dtype)
    return rows, weights, token_index, keep, padded


def unpermute(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum each row back into its token (the k expert outputs of a token add up)."""
    out = rows.new_zeros(num_tokens, rows.shape[-1])
    return out.index_add(0, token_index, rows)


class AllToAllDispatcher:
    """``pad_multiple`` (``--moe-router-padding-for-fp8``): every expert's token count on every rank is
    padded to a multiple of it (:func:`permute_padded`), so each expert receives a multiple in total."""

    def __init__(self, config, state, pad_multiple: int | None = None):
        self.pad_multiple = pad_multiple
        self.num_experts = config.num_experts
        self.ep_group, self.etp_group = state.ep_group, expert_tp_group(config, state)
        self.ep_size, self.etp_size = state.ep_size, comm.group_size(self.etp_group)
        self.etp_rank = comm.group_rank(self.etp_group)
        self.num_local = config.num_experts // state.ep_size
        self.first = state.ep_rank * self.num_local
        self.bytes_sent = 0  # token-activation bytes this rank sent in the EP all-to-all (dispatch + combine)

    def run(self, hidden, probs, routing_map, experts):
        rows, weights, tokens_per_expert, ctx = self.dispatch(hidden, probs, routing_map)
        return self.combine(experts(rows, weights, tokens_per_expert), ctx)

    def dispatch(self, hidden, probs, routing_map):
        keep = None
        if self.pad_multiple:
            rows, weights, token_index, keep, routing_map = permute_padded(hidden, probs, routing_map, self.pad_multiple)
        else:
            rows, weights, token_index = permute(hidden, probs, routing_map)
        counts = routing_map.sum(dim=0)
        groups = (self.ep_group,) + ((self.etp_group,) if self.etp_size > 1 else ())
        # received[t, j, i]: rows for local expert i from EP rank j (on expert-tensor rank t)
        everyone = _gather_counts(counts, *groups).view(self.etp_size, self.ep_size, self.num_experts)
        received = everyone[:, :, self.first:self.first + self.num_local].cpu()
        input_splits = counts.view(self.ep_size, self.num_local).sum(dim=1).tolist()
        output_splits = received[self.etp_rank].sum(dim=1).tolist()
        rows = comm.all_to_all(rows, self.ep_group, output_splits, input_splits, kind="ep")
        weights = comm.all_to_all(weights, self.ep_group, output_splits, input_splits, kind="ep")
        sent = sum(input_splits) - input_splits[comm.group_rank(self.ep_group)]
        self.bytes_sent += 2 * rows.element_size() * rows.shape[-1] * sent
        etp_sizes = received.sum(dim=(1, 2)).tolist()
        rows = all_gather_v(rows, self.etp_group, etp_sizes)
        weights = all_gather_v(weights, self.etp_group, etp_sizes)
        order = _chunk_order(received.reshape(-1, self.num_local)).to(rows.device)
        tokens_per_expert = received.sum(dim=(0, 1)).tolist()
        ctx = (token_index, hidden.shape[0], input_splits, output_splits, etp_sizes, torch.argsort(order), keep)
        return rows.index_select(0, order), weights.index_select(0, order), tokens_per_expert, ctx

    def combine(self, rows, ctx):
        token_index, num_tokens, input_splits, output_splits, etp_sizes, inverse, keep = ctx
        rows = reduce_scatter_v(rows.index_select(0, inverse), self.etp_group, etp_sizes)
        rows = comm.all_to_all(rows, self.ep_group, input_splits, output_splits, kind="ep")
        if keep is not None:  # padding rows: no output, so no output gradient reaches the experts
            rows = rows * keep.to(rows.dtype)
        return unpermute(rows, token_index, num_tokens)


class AllGatherDispatcher:
    def __init__(self, config, state):
        self.groups = tuple(g for g in (expert_tp_group(config, state), state.ep_group) if comm.group_size(g) > 1)
        self.num_local = config.num_experts // state.ep_size
        self.first = state.ep_rank * self.num_local

    def run(self, hidden, probs, routing_map, experts):
        rows, weights, tokens_per_expert, ctx = self.dispatch(hidden, probs, routing_map)
        return self.combine(experts(rows, weights, tokens_per_expert), ctx)

    def dispatch(self, hidden, probs, routing_map):
        for group in self.groups:  # TP innermost: the gathered order is (ep rank, tp rank, token)
            hidden = comm.gather_from_sp(hidden, group, tensor_parallel_output_grad=True, kind="ep")
            probs = comm.gather_from_sp(probs, group, tensor_parallel_output_grad=True, kind="ep")
            with torch.no_grad():
                routing_map = comm.gather_from_sp(routing_map.to(torch.uint8), group, kind="ep").bool()
        local = slice(self.first, self.first + self.num_local)
        local_map = routing_map[:, local]
        rows, weights, token_index = permute(hidden, probs[:, local], local_map)
        return rows, weights, local_map.sum(dim=0).tolist(), (token_index, hidden.shape[0])

    def combine(self, rows, ctx):
        token_index, num_tokens = ctx
        out = unpermute(rows, token_index, num_tokens)
        for group in reversed(self.groups):
            out = comm.reduce_scatter_to_sp(out, group, kind="ep")
        return out
