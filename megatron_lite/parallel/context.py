"""Context parallelism (CP): the sequence of every sample is split over the CP group.

Load-balanced split. The sequence is cut into ``2 * cp`` equal chunks and CP rank ``r`` keeps
chunks ``r`` and ``2cp-1-r``, in that order (e.g. S=24, cp=3: rank 0 holds positions 0-3 and
20-23, rank 1 4-7 and 16-19, rank 2 8-15). Under a causal mask an early chunk has little to attend
to and a late one a lot; pairing them gives every rank the same attention work. Tokens, labels,
loss mask and position ids are split the same way (:func:`get_batch_on_this_cp_rank`), so
position embeddings and RoPE use each token's global position.

Core attention over the split sequence (``cp_comm_type``):

* ``p2p`` - ring attention (:mod:`megatron_lite.parallel.ring_attention`): keys/values travel
  around the ring, overlapped with the block computations; memory per rank O(S/cp).
* ``a2a`` - DeepSpeed-Ulysses: an all-to-all turns sequence-sharded q/k/v ``[S/cp, b, n, d]`` into
  head-sharded ``[S, b, n/cp, d]``, attention runs on the full sequence for ``n/cp`` heads, and an
  all-to-all turns the output back. Needs the (TP-local) query heads and key/value groups
  divisible by cp.
* ``allgather`` - keys and values are all-gathered over CP and each rank attends its own queries
  to them under a mask built from global positions (simplest; O(S) keys per rank).
* ``a2a+p2p`` - hierarchical (``--hierarchical-context-parallel-sizes A B``, A x B = cp): Ulysses
  over A consecutive CP ranks, then the ring over the B such groups on the gathered chunks with
  n/A heads, then Ulysses back (:func:`hierarchical_attention`; groups built by ``ParallelState``).

All four equal single-process attention up to summation order, also with a sliding window
(``--window-size``, applied by the tokens' global positions) and with packed documents
(integer document ids as the attention mask, :mod:`~megatron_lite.parallel.document_mask`): the
ring carries each block's key ids with its keys, a2a and allgather gather the ids. Attention sinks
(``--softmax-type``): the ring adds them once per row; a2a (and a2a+p2p) pass each rank the sinks of
the head group it attends, and a2a / allgather run :func:`~megatron_lite.parallel.ring_attention.local_attention`
instead of SDPA (which has no sink). Gradient reductions over CP
(each CP rank holds different tokens of the same replica) happen in the data-parallel gradient
reduction over the DP x CP group, not here.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .attention_sink import sink_logits, softmax_offset
from .document_mask import causal_document_mask, document_allowed, is_document_ids
from .ring_attention import local_attention, ring_attention
from .sliding_window import window_allowed

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


# ---------------------------------------------------------------------------------------------
# The load-balanced split.


def cp_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions of the tokens CP rank ``cp_rank`` holds, in its local order (LongTensor)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"the sequence length {seq_len} (--seq-length) is not divisible by 2 x --context-parallel-size "
                         f"{cp_size} (ParallelState's cp): use a multiple of {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def split_for_cp(t: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (the sequence), concatenated; cp 1 = ``t``."""
    if cp_size == 1:
        return t
    index = cp_positions(t.shape[dim], cp_rank, cp_size, device=t.device)
    return t.index_select(dim, index)


def unsplit_from_cp(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`split_for_cp`: the full tensor from every CP rank's part, in rank order."""
    cp = len(parts)
    local = parts[0].shape[dim]
    order = torch.cat([cp_positions(local * cp, r, cp) for r in range(cp)])
    gathered = torch.cat(parts, dim=dim)
    return gathered.index_select(dim, torch.argsort(order).to(gathered.device))


def get_batch_on_this_cp_rank(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """Split a micro-batch dict along the sequence for this CP rank.

    ``tokens, labels, loss_mask, position_ids, document_ids`` ``[b, s]`` are split on dim 1;
    ``attention_mask`` ``[b, 1, s, s]`` on dim 2 (its query rows); multi-token prediction's ``mtp_*``
    ``[D, b, s]`` on dim 2. Missing ``position_ids`` are created (``0..s-1``) first, so the split keeps
    each token's global position. Other entries are left alone.
    """
    if cp_size == 1:
        return batch
    out = dict(batch)
    tokens = batch.get("tokens")
    if batch.get("position_ids") is None and tokens is not None:
        out["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    for key in ("tokens", "labels", "loss_mask", "position_ids", "document_ids"):
        if out.get(key) is not None:
            out[key] = split_for_cp(out[key], 1, cp_rank, cp_size)
    for key in ("attention_mask", "mtp_tokens", "mtp_labels", "mtp_loss_mask"):
        if out.get(key) is not None:
            out[key] = split_for_cp(out[key], 2, cp_rank, cp_size)
    return out


# ---------------------------------------------------------------------------------------------
# Ulysses (a2a) and all-gather attention. Tensors are [s, b, heads, d] (the core-attention layout).


def _gathered_positions(local_len: int, cp: int, device, ring_rank: int = 0, ring: int = 1) -> torch.Tensor:
    """Global position of each row of a tensor gathered in rank order over ``cp`` consecutive CP ranks,
    those of all-to-all group ``ring_rank`` of ``ring`` (a2a+p2p; the whole CP group when ``ring`` is 1)."""
    total = cp * ring
    return torch.cat([cp_positions(local_len * total, ring_rank * cp + r, total, device=device) for r in range(cp)])


def seq_to_heads(x: torch.Tensor, group, ring_rank: int = 0, ring: int = 1) -> torch.Tensor:
    """``[s/cp, b, n, d]`` (this rank's chunks) -> ``[s, b, n/cp, d]`` (ascending positions, head group r).

    Under a2a+p2p ``group`` is the all-to-all group ``ring_rank`` of ``ring``: its ``cp`` ranks' chunks
    sorted by position are chunks ``ring_rank`` and ``2 ring - 1 - ring_rank`` of ``2 ring`` (the ring's
    load-balanced layout with ``ring`` ranks)."""
    cp = comm.group_size(group)
    s, b, n, d = x.shape
    x = x.reshape(s, b, cp, n // cp, d).permute(2, 0, 1, 3, 4).reshape(cp * s, b, n // cp, d)
    x = comm.all_to_all(x, group, kind="cp")  # row block p: rank p's tokens of my head group
    return x.index_select(0, torch.argsort(_gathered_positions(s, cp, x.device, ring_rank, ring)))


def heads_to_seq(x: torch.Tensor, group, ring_rank: int = 0, ring: int = 1) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``[s, b, n/cp, d]`` -> ``[s/cp, b, n, d]``."""
    cp = comm.group_size(group)
    full, b, n_local, d = x.shape
    s = full // cp
    x = x.index_select(0, torch.argsort(torch.argsort(_gathered_positions(s, cp, x.device, ring_rank, ring))))
    x = comm.all_to_all(x, group, kind="cp")  # row block p: my tokens of head group p
    return x.reshape(cp, s, b, n_local, d).permute(1, 2, 0, 3, 4).reshape(s, b, cp * n_local, d)


def _sdpa(q, k, v, mask, causal: bool, dropout_p: float, scale: float, sink=None, seed: int = 0):
    """SDPA on ``[s, b, heads, d]`` tensors (``mask`` True = may attend); returns ``[sq, b, nq, d]``.
    With a ``sink`` (``[nq]``) the block kernels, which add it, instead (dropout seeded by ``seed``)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if sink is not None:  # the block kernels take a mask as [b or 1, 1, sq, sk] (a2a's window, allgather's are 2-D)
        mask = mask if mask is None or mask.dim() == 4 else mask.view(1, 1, *mask.shape[-2:])
        return local_attention(q, k, v, causal and mask is None, scale, dropout_p, seed, mask, sink).permute(2, 0, 1, 3)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=causal and mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.permute(2, 0, 1, 3)


def _gathered_ids(ids: torch.Tensor, group) -> torch.Tensor:
    """Every CP rank's document ids ``[b, s/cp]`` gathered in rank order: ``[b, s]``."""
    return comm._all_gather(ids, 1, group, kind="cp")


def _windowed(mask, window, causal: bool, q_pos, k_pos):
    """``mask`` (True = may attend, or None: causal / full) confined to ``window`` by global positions."""
    if window is None:
        return mask
    band = window_allowed(q_pos, k_pos, window)
    if mask is None and causal:
        band &= k_pos <= q_pos.unsqueeze(-1)
    return band if mask is None else mask & band


def _head_share(sink, group):
    """The sinks of the query heads this rank attends after the all-to-all (its head group), or None."""
    if sink is None:
        return None
    n = sink.shape[0] // comm.group_size(group)
    return sink[comm.group_rank(group) * n:(comm.group_rank(group) + 1) * n]


def ulysses_attention(q, k, v, group, causal: bool, scale: float, dropout_p: float = 0.0, document_ids=None,
                      window=None, sink=None, seed: int = 0):
    """All-to-all (DeepSpeed-Ulysses) attention; ``[s/cp, b, heads, d]`` in, ``[s/cp, b, nq, d]`` out.
    ``sink`` (``[nq]``, this rank's query heads before the all-to-all) is cut to the heads attended here."""
    cp = comm.group_size(group)
    for name, t in (("query heads", q), ("key/value groups", k)):
        if t.shape[2] % cp:
            raise ValueError(f"--cp-comm-type a2a needs this tensor-parallel rank's {t.shape[2]} {name} divisible by "
                             f"--context-parallel-size {cp}: use --cp-comm-type p2p, or --num-attention-heads and "
                             "--num-query-groups divisible by --tensor-model-parallel-size x --context-parallel-size")
    mask = None
    if document_ids is not None:  # the whole sequence's ids, in global order
        order = torch.argsort(_gathered_positions(q.shape[0], cp, q.device))
        ids = _gathered_ids(document_ids, group).index_select(1, order)
        mask = causal_document_mask(ids) if causal else document_allowed(ids, ids)
    pos = torch.arange(q.shape[0] * cp, device=q.device)  # after the all-to-all: the whole sequence, in order
    mask = _windowed(mask, window, causal, pos, pos)
    q, k, v = (seq_to_heads(t, group) for t in (q, k, v))
    return heads_to_seq(_sdpa(q, k, v, mask, causal, dropout_p, scale, _head_share(sink, group), seed), group)


def allgather_attention(q, k, v, group, causal: bool, scale: float, dropout_p: float = 0.0, document_ids=None,
                        window=None, sink=None, seed: int = 0):
    """Keys/values all-gathered over CP (gradients reduce-scattered back); own queries attend them."""
    cp, rank = comm.group_size(group), comm.group_rank(group)
    s, dk = q.shape[0], k.shape[-1]
    kv = comm.gather_from_sp(torch.cat([k, v], dim=-1), group, tensor_parallel_output_grad=True, kind="cp")
    mask = None
    q_pos, k_pos = cp_positions(s * cp, rank, cp, device=q.device), _gathered_positions(s, cp, q.device)
    if causal:
        mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [s, s * cp]; True = may attend
    mask = _windowed(mask, window, causal, q_pos, k_pos)
    if document_ids is not None:
        same = document_allowed(document_ids, _gathered_ids(document_ids, group))
        mask = same if mask is None else same & mask
    return _sdpa(q, kv[..., :dk], kv[..., dk:], mask, False, dropout_p, scale, sink, seed)


def hierarchical_attention(q, k, v, a2a_group, ring_group, causal: bool, scale: float, dropout_p: float = 0.0,
                           seed: int = 0, document_ids=None, window=None, sink=None):
    """a2a+p2p: Ulysses over the all-to-all group, ring attention over the ring group, Ulysses back.

    ``[s/cp, b, heads, d]`` in, ``[s/cp, b, nq, d]`` out. After the all-to-all this rank holds its
    group's chunks for ``1/A`` of the heads, sorted by position: chunks ``o`` and ``2B-1-o`` of ``2B``
    for all-to-all group ``o`` of ``B``, which is the ring's own load-balanced layout over B ranks, so
    the ring's causal plan applies unchanged. Document ids are gathered and sorted the same way.
    """
    a2a = comm.group_size(a2a_group)
    ring, ring_rank = comm.group_size(ring_group), comm.group_rank(ring_group)
    for name, t in (("query heads", q), ("key/value groups", k)):
        if t.shape[2] % a2a:
            raise ValueError(f"--cp-comm-type a2a+p2p needs this tensor-parallel rank's {t.shape[2]} {name} divisible "
                             f"by the all-to-all size {a2a} (the first of --hierarchical-context-parallel-sizes): use "
                             "--cp-comm-type p2p, or --num-attention-heads and --num-query-groups divisible by "
                             "--tensor-model-parallel-size x that size")
    ids = None
    if document_ids is not None:
        order = torch.argsort(_gathered_positions(q.shape[0], a2a, q.device, ring_rank, ring))
        ids = _gathered_ids(document_ids, a2a_group).index_select(1, order)
    qh, kh, vh = (seq_to_heads(t, a2a_group, ring_rank, ring).permute(1, 2, 0, 3) for t in (q, k, v))
    out = ring_attention(qh, kh, vh, ring_group, causal, scale, dropout_p, seed, ids, window,
                         _head_share(sink, a2a_group))  # [b, nq/A, A*s, dv]
    return heads_to_seq(out.permute(2, 0, 1, 3), a2a_group, ring_rank, ring)


# ---------------------------------------------------------------------------------------------
# The core-attention module.


class ContextParallelAttention(nn.Module):
    """Core attention over a CP-split sequence: ``forward(q, k [s, b, n, dk], v [s, b, nkv, dv],
    attention_mask, causal) -> [s, b, nq * dv]`` with ``s`` = this rank's share of the sequence (the
    value head size may differ from the query/key one, as in MLA). The logits' scale is the
    config's ``attention_scale`` when it has one (--softmax-scale, MLA's), else ``1 / sqrt(dk)``.

    ``config.cp_comm_type`` picks p2p (ring, default), a2a (Ulysses), allgather or a2a+p2p (Ulysses
    inside the state's ``cp_a2a`` groups, the ring across them over ``cp_ring``). The mask is the
    implicit causal one, confined to packed documents when ``attention_mask`` holds document ids
    ``[b, s]`` (this rank's tokens); dense boolean masks are refused. Attention dropout: each call draws
    one seed from the model-parallel RNG tracker (so recomputation replays it), offset by the CP
    rank; the ring (also a2a+p2p's) seeds its blocks from it, a2a/allgather run SDPA's dropout under it.
    """

    compile_eagerly = True  # --torch-compile: a graph break (fusions/compile.py)

    def __init__(self, config, state, layer_number: int):
        super().__init__()
        if hasattr(config, "cp_comm_type_of"):  # a TransformerConfig: one type, or one per layer
            self.comm_type = config.cp_comm_type_of(layer_number)
        else:
            self.comm_type = getattr(config, "cp_comm_type", None) or "p2p"
        if self.comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type {self.comm_type!r} (TransformerConfig.cp_comm_type) is not one of "
                             f"{', '.join(CP_COMM_TYPES)}")
        self.group, self.cp_size, self.cp_rank = state.cp_group, state.cp_size, state.cp_rank
        self.dropout_p = config.attention_dropout
        self.scale = getattr(config, "attention_scale", getattr(config, "softmax_scale", None))
        self.tracker = state.rng_tracker
        self.sliding_window = config.window_of(layer_number) if hasattr(config, "window_of") else None  # or (l, r)
        self.softmax_type = getattr(config, "softmax_type", "vanilla")  # --softmax-type: attention_sink.py
        self.softmax_offset = softmax_offset(config, state)  # the learnable sinks of this rank's heads, or None
        tp, cp = state.tp_size, state.cp_size
        heads = config.num_attention_heads
        groups = getattr(config, "num_query_groups", None) or heads
        if self.comm_type == "a2a" and (heads % (tp * cp) or groups % (tp * cp)):
            raise ValueError(f"--cp-comm-type a2a needs --num-attention-heads {heads} and --num-query-groups {groups} "
                             f"(TransformerConfig.num_attention_heads, .num_query_groups) divisible by "
                             f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp} (ParallelState's tp x cp); "
                             "use --cp-comm-type p2p or allgather, or heads and groups that divide")
        if self.comm_type == "a2a+p2p":
            self._init_hierarchical(state, heads, groups)

    def _init_hierarchical(self, state, heads: int, groups: int) -> None:
        sizes = getattr(state, "hcp_sizes", None)
        if sizes is None:
            raise ValueError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B "
                             f"(A x B = --context-parallel-size {state.cp_size}; ParallelState(hcp=(A, B)) from Python)")
        a2a, tp = sizes[0], state.tp_size
        if heads % (tp * a2a) or groups % (tp * a2a):
            raise ValueError(f"--cp-comm-type a2a+p2p needs --num-attention-heads {heads} and --num-query-groups "
                             f"{groups} (TransformerConfig.num_attention_heads, .num_query_groups) divisible by "
                             f"--tensor-model-parallel-size {tp} x the all-to-all size {a2a} (the first of "
                             "--hierarchical-context-parallel-sizes); use a smaller all-to-all size or --cp-comm-type p2p")
        self.a2a_group, self.ring_group = state.group("cp_a2a"), state.group("cp_ring")

    def _rng(self):
        """The tensor-parallel generator around dropout (each TP rank owns different heads)."""
        if self.dropout_p == 0.0 or not self.training:
            return contextlib.nullcontext()
        return self.tracker.fork()

    def forward(self, q, k, v, attention_mask=None, causal: bool = True):
        if attention_mask is not None and not is_document_ids(attention_mask):
            raise ValueError("context parallelism takes the causal mask or document ids, not a dense "
                             "[b, 1, s, s] attention mask")
        s, b, nq, d = q.shape
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(d)
        p = self.dropout_p if self.training else 0.0
        with self._rng():
            # One draw per call from the tracker, offset by the CP rank: the tracker's generator is
            # the same on every CP rank, but their queries (or heads) differ, so must their masks.
            seed = int(torch.randint(0, 2**62, (1,), device=q.device).item()) + 1000003 * self.cp_rank if p > 0 else 0
        sink = sink_logits(self.softmax_type, self.softmax_offset, nq, q.device)
        if self.comm_type == "p2p":  # the ring seeds each block from it (and replays them in backward)
            qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
            out = ring_attention(qh, kh, vh, self.group, causal, scale, p, seed, attention_mask,
                                 self.sliding_window, sink).permute(2, 0, 1, 3)
        elif self.comm_type == "a2a+p2p":  # the ring inside seeds its blocks the same way
            out = hierarchical_attention(q, k, v, self.a2a_group, self.ring_group, causal, scale, p, seed,
                                         attention_mask, self.sliding_window, sink)
        else:  # SDPA's dropout under the seeded generator; with a sink the block kernels seed their own masks
            attend = ulysses_attention if self.comm_type == "a2a" else allgather_attention
            with _seeded(seed, q.device) if p > 0 else contextlib.nullcontext():
                out = attend(q, k, v, self.group, causal, scale, p, attention_mask, self.sliding_window, sink, seed)
        return out.reshape(s, b, nq * v.shape[-1])


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    """Run the block with the device's default generator seeded by ``seed``, restoring it after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # CPU state always forked
        torch.manual_seed(seed)
        yield
