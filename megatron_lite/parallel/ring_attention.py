"""Ring attention: exact attention over a sequence split across the context-parallel (CP) group.

Each CP rank holds the queries, keys and values of its two load-balanced chunks (see
:mod:`megatron_lite.parallel.context`): rank ``r`` of ``cp`` holds chunks ``r`` and ``2cp-1-r`` of
the ``2cp`` equal chunks of the sequence, so its local sequence is ``[chunk r ; chunk 2cp-1-r]``.

Forward. The keys and values travel around the ring (send to ``r+1``, receive from ``r-1``) in one
buffer, with batched isend/irecv. At step ``i`` a rank holds the keys/values of rank
``j = (r - i) mod cp`` and starts the transfer for step ``i+1`` before computing step ``i``, so the
transfer overlaps the block's attention. With a causal mask the block at step ``i`` is one of:

* ``i == 0`` (own keys): causal attention over the local two-chunk sequence;
* ``j < r``: every local query against the first remote chunk only (chunk ``j`` lies entirely before
  both local chunks, chunk ``2cp-1-j`` entirely after them) - no mask;
* ``j > r``: only the second local chunk (``2cp-1-r``) against both remote chunks - no mask.

Every block is two chunk-by-chunk products (each rank does the same work; masked-out blocks are
never computed). Without a causal mask every step is all-against-all. Partial results merge by
their log-sum-exp: ``lse = logaddexp(lse, lse_i)``, ``out = out * exp(lse_old - lse) + o_i *
exp(lse_i - lse)`` (fp32 accumulators).

Backward. The same blocks are replayed with the same key/value ring. Each block's gradients come
from the *final* output and log-sum-exp (the probabilities are recomputed as ``exp(s - lse)``),
so they are exact pieces of the full gradient. ``dQ`` accumulates locally; a ``dK/dV`` buffer
travels with the keys/values it belongs to and each rank adds its contribution; one last hop
delivers the complete ``dK/dV`` to its owner. Both transfers overlap computation: the next
key/value buffer travels while the current block's gradients are computed, and the incoming
``dK/dV`` buffer is waited for only after them, just before this rank adds its share.

Block kernels (:func:`block_forward`, :func:`block_backward`) return/consume the log-sum-exp: on
CPU PyTorch's fused flash-attention kernels (no score matrix is materialised), elsewhere or with
dropout a plain fp32 implementation. Dropout masks are drawn from a per-block seed, so backward
regenerates them exactly. GQA/MQA: key/value head ``j`` serves query heads ``[j*g, (j+1)*g)``.
Values may have another head size than queries and keys (MLA): the ring buffer is ``[k | v]``
along the channels, and the CPU flash kernels, which want one head size, see zero-padded tensors.

Packed documents (:mod:`~megatron_lite.parallel.document_mask`): with document ids ``[b, s]`` for
the local tokens, the key ids travel around the ring with the keys and values, and every block is
further confined to query/key pairs of the same document. A block row whose query sees none of the
block's keys contributes nothing (its log-sum-exp is -inf); the query's own key, seen at step 0,
keeps every final row finite. A sliding window (``window``) confines every block the same way, by the
global positions of its queries and keys (each rank's two chunks, :func:`_positions`). A block none
of whose queries sees any of its keys is skipped, forward and backward (its keys still travel on).

Attention sinks (``sink``, :mod:`~megatron_lite.parallel.attention_sink`) join each row once, after
every block has been merged: ``lse = logaddexp(lse, sink)``, the output rescaled. Backward replays
the blocks unchanged from that final output and log-sum-exp; the sink's gradient comes from the rows
this rank holds. :func:`local_attention` is the same kernels on one rank with any boolean mask (the
core attention's path for sinks, which SDPA does not have).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..perf.comm_volume import record, tensor_bytes
from .attention_sink import merge_sink, sink_grad
from .document_mask import document_allowed
from .sliding_window import chunk_positions, window_allowed

# ---------------------------------------------------------------------------------------------
# Block kernels: tensors are [batch, heads, seq, head_dim]; lse is [batch, q_heads, seq].


def _use_cpu_flash(q: torch.Tensor, dropout_p: float) -> bool:
    return q.device.type == "cpu" and dropout_p == 0.0 and q.dtype in (torch.float32, torch.float64, torch.bfloat16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _keep_mask(shape, dropout_p: float, seed: int, device) -> torch.Tensor:
    """The dropout keep-mask of one block, a pure function of ``seed`` (replayed in backward)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device) >= dropout_p


def _with_causal(allowed, causal: bool, sq: int, sk: int):
    """``allowed`` (bool ``[b, 1, sq, sk]``, True = may attend) with the top-left causal mask folded in."""
    if not causal:
        return allowed
    return allowed & torch.ones(sq, sk, dtype=torch.bool, device=allowed.device).tril()


def _additive(allowed, dtype):
    """The CPU flash kernels' form of a mask: 0 where allowed, -inf elsewhere, in the query's dtype."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _plain_probs(q, k, causal: bool, scale: float, lse=None, allowed=None):
    """Grouped scores -> (probabilities ``[b, nkv, g, sq, sk]``, lse ``[b, nkv, g, sq]``).

    With ``lse`` given (backward) the probabilities are normalised by it instead of their own sum.
    ``allowed`` (bool ``[b, 1, sq, sk]``) confines the block further; a row it empties has lse -inf
    and probabilities 0.
    """
    b, nq, sq, d = q.shape
    nkv = k.shape[1]
    acc = _acc_dtype(q.dtype)
    qg = q.reshape(b, nkv, nq // nkv, sq, d).to(acc)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(acc)) * scale
    if causal:
        upper = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        lse = lse.reshape(b, nkv, nq // nkv, sq)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)  # an empty row: exp(-inf - 0) = 0, not NaN
    return torch.exp(scores - finite.unsqueeze(-1)), lse


def _pad(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` with zero channels appended up to ``size`` (the CPU flash kernels want one head size)."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def block_forward(q, k, v, causal: bool, scale: float, dropout_p: float = 0.0, seed: int = 0, allowed=None):
    """Attention of one block: ``(out [b, nq, sq, dv] in fp32 (fp64 for fp64), lse [b, nq, sq])``.

    ``causal`` is the top-left aligned mask of a square block (query i sees keys 0..i); ``allowed``
    (bool ``[b, 1, sq, sk]`` or None) confines it further (packed documents).
    """
    acc = _acc_dtype(q.dtype)
    dv = v.shape[-1]
    if _use_cpu_flash(q, dropout_p):
        d = max(q.shape[-1], dv)  # zero channels change neither the scores nor the kept outputs
        q, k, v = _pad(q, d), _pad(k, d), _pad(v, d)
        if allowed is None:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out[..., :dv].to(acc), lse.to(acc)
        allowed = _with_causal(allowed, causal, q.shape[2], k.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=_additive(allowed, q.dtype), scale=scale)
        lse = lse.to(acc).masked_fill(~allowed.any(-1), float("-inf"))  # the kernel reports 0 for an empty row
        return out[..., :dv].to(acc), lse
    b, nq, sq, _ = q.shape
    probs, lse = _plain_probs(q, k, causal, scale, allowed=allowed)
    if dropout_p > 0:
        probs = probs * (_keep_mask(probs.shape, dropout_p, seed, q.device).to(acc) / (1.0 - dropout_p))
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v.to(acc))
    return out.reshape(b, nq, sq, dv), lse.reshape(b, nq, sq)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, dropout_p: float = 0.0, seed: int = 0,
                   allowed=None):
    """Gradients ``(dq, dk, dv)`` of one block, given the FINAL output and log-sum-exp of these queries.

    ``out`` is in ``q``'s dtype, ``lse`` in the accumulation dtype. Returns accumulation-dtype tensors.
    """
    acc = _acc_dtype(q.dtype)
    dk_size, dv_size = q.shape[-1], v.shape[-1]
    if _use_cpu_flash(q, dropout_p):
        d = max(dk_size, dv_size)
        mask = {}
        if allowed is not None:
            mask = {"attn_mask": _additive(_with_causal(allowed, causal, q.shape[2], k.shape[2]), q.dtype)}
            causal = False
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad(dout, d), _pad(q, d), _pad(k, d), _pad(v, d), _pad(out, d),
            lse.to(torch.float32) if q.dtype != torch.float64 else lse, 0.0, causal, scale=scale, **mask)
        dq, dk, dv = (g.to(acc) for g in grads)
        return dq[..., :dk_size], dk[..., :dk_size], dv[..., :dv_size]
    b, nq, sq, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    probs, _ = _plain_probs(q, k, causal, scale, lse, allowed)
    dout_g = dout.reshape(b, nkv, g, sq, dv_size).to(acc)
    dprobs = torch.einsum("bhgqd,bhkd->bhgqk", dout_g, v.to(acc))
    dropped = probs
    if dropout_p > 0:
        keep = _keep_mask(probs.shape, dropout_p, seed, q.device).to(acc) / (1.0 - dropout_p)
        dropped, dprobs = probs * keep, dprobs * keep
    dv = torch.einsum("bhgqk,bhgqd->bhkd", dropped, dout_g)
    row_dot = (dout.to(acc) * out.to(acc)).sum(-1).reshape(b, nkv, g, sq, 1)  # = sum_k P * dP
    dscores = probs * (dprobs - row_dot) * scale
    dq = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k.to(acc)).reshape(b, nq, sq, d)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, q.reshape(b, nkv, g, sq, d).to(acc))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# The ring.


class Ring:
    """Neighbours of this rank in the CP group; ``shift(*tensors)`` starts sending the tensors to the
    next rank and receiving the previous rank's tensors of the same shapes, returning a handle whose
    ``wait()`` gives the received tensors (a tuple)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, *tensors: torch.Tensor) -> _Pending:
        recvs, ops = [], []
        for t in tensors:
            recv = torch.empty_like(t)
            record("cp", "send", tensor_bytes(t), self.size)
            ops += [dist.P2POp(dist.isend, t, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
            recvs.append(recv)
        return _Pending(dist.batch_isend_irecv(ops), tuple(recvs))


class _Pending:
    def __init__(self, requests, recvs):
        self.requests, self.recvs = requests, recvs

    def wait(self) -> tuple:
        for req in self.requests:
            req.wait()
        return self.recvs


def block_plan(step: int, rank: int, size: int, causal: bool, half: int):
    """``(query slice, key/value slice, block is causal)`` over the local sequence at ``step``."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    source = (rank - step) % size
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _merge(out, lse, block_out, block_lse) -> None:
    """Fold one block's (output, lse) into the running accumulators (views, updated in place)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _allowed(q_ids, kv_ids, qs, ks, window=None, q_pos=None, k_pos=None):
    """The document mask of one block, confined to the sliding ``window`` by the global positions of its
    queries ``q_pos`` and keys ``k_pos`` (None without document ids and window)."""
    allowed = None if q_ids is None else document_allowed(q_ids[:, qs], kv_ids[:, ks])
    if window is None:
        return allowed
    band = window_allowed(q_pos[qs], k_pos[ks], window).unsqueeze(0).unsqueeze(0)  # [1, 1, sq, sk]
    return band if allowed is None else allowed & band


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, dropout_p, seed, ring, ids, window, sink):
        acc = _acc_dtype(q.dtype)
        half = q.shape[2] // 2
        b, nq, s, dk = q.shape
        # laid out as [s, b, nq, dv] so the caller's [s, b, nq * dv] view of it needs no copy
        out = torch.zeros((s, b, nq, v.shape[-1]), dtype=acc, device=q.device).permute(1, 2, 0, 3)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        travel = (torch.cat([k, v], dim=-1),) + ((ids,) if ids is not None else ())  # kv: [b, nkv, s, dk + dv]
        for step in range(ring.size):
            pending = ring.shift(*travel) if step < ring.size - 1 else None  # overlaps this step's block
            kv, kv_ids = travel[0], travel[-1]
            qs, ks, block_causal = block_plan(step, ring.rank, ring.size, causal, half)
            allowed = _allowed(ids, kv_ids, qs, ks, window, *_positions(window, s, ring, step, q.device))
            if not _nothing_seen(allowed):
                block_out, block_lse = block_forward(q[:, :, qs], kv[:, :, ks, :dk], kv[:, :, ks, dk:], block_causal,
                                                     scale, dropout_p, seed + step, allowed)
                _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if pending is not None:
                travel = pending.wait()
        if sink is not None:  # once per row, after every block
            lse = merge_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, ids, sink)
        ctx.causal, ctx.scale, ctx.dropout_p, ctx.seed, ctx.ring = causal, scale, dropout_p, seed, ring
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, ids, sink = ctx.saved_tensors
        ring, dout = ctx.ring, dout.contiguous()
        acc = lse.dtype
        half, dk = q.shape[2] // 2, k.shape[-1]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        travel = (torch.cat([k, v], dim=-1),) + ((ids,) if ids is not None else ())
        dkv_pending = None
        for step in range(ring.size):
            kv_pending = ring.shift(*travel) if step < ring.size - 1 else None
            kv, kv_ids = travel[0], travel[-1]
            qs, ks, block_causal = block_plan(step, ring.rank, ring.size, ctx.causal, half)
            allowed = _allowed(ids, kv_ids, qs, ks, ctx.window, *_positions(ctx.window, q.shape[2], ring, step, q.device))
            skip = _nothing_seen(allowed)
            if not skip:
                dq_i, dk_i, dv_i = block_backward(dout[:, :, qs], q[:, :, qs], kv[:, :, ks, :dk], kv[:, :, ks, dk:],
                                                  out[:, :, qs], lse[:, :, qs], block_causal, ctx.scale,
                                                  ctx.dropout_p, ctx.seed + step, allowed)
                dq[:, :, qs] += dq_i
            # the dK/dV partial sums of the keys/values held now (their owner is rank r - step)
            dkv = torch.zeros(kv.shape, dtype=acc, device=k.device) if dkv_pending is None else dkv_pending.wait()[0]
            if not skip:
                dkv[:, :, ks, :dk] += dk_i
                dkv[:, :, ks, dk:] += dv_i
            dkv_pending = ring.shift(dkv)
            if kv_pending is not None:
                travel = kv_pending.wait()
        dkv = dkv_pending.wait()[0]  # after size hops: this rank's own dK/dV, summed over every rank
        dsink = sink_grad(dout, out, lse, sink) if ctx.needs_input_grad[10] else None
        return (dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype),
                None, None, None, None, None, None, None, dsink)


def _nothing_seen(allowed) -> bool:
    """Whether no query of a block may see any of its keys (a remote chunk wholly outside the sliding
    window, or of other documents): the block adds nothing and is not computed. Step 0 never is."""
    return allowed is not None and not bool(allowed.any())


def _positions(window, local_len: int, ring: Ring, step: int, device):
    """Global positions of this rank's queries and of the keys held at ``step`` (None, None without a window)."""
    if window is None:
        return None, None
    source = (ring.rank - step) % ring.size
    return (chunk_positions(local_len, ring.rank, ring.size, device),
            chunk_positions(local_len, source, ring.size, device))


def ring_attention(q, k, v, group, causal: bool, scale: float, dropout_p: float = 0.0, seed: int = 0,
                   document_ids=None, window=None, sink=None):
    """Exact attention of the local queries against the whole (CP-split, load-balanced) sequence.

    ``q, k [b, n, s, dk]``, ``v [b, nkv, s, dv]`` with ``s`` this rank's two chunks; returns
    ``[b, nq, s, dv]``. ``group`` None (one rank) is plain attention over the local sequence.
    ``seed`` seeds the dropout masks of the blocks (ignored when ``dropout_p == 0``).
    ``document_ids`` (int ``[b, s]``, this rank's tokens) confines attention to each packed document,
    ``window`` (``(left, right)`` or None) to a sliding window over the tokens' global positions.
    ``sink`` (fp32 ``[nq]`` or None): each head's sink logit (:mod:`~megatron_lite.parallel.attention_sink`).
    """
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even local sequence length (two chunks), got {q.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not divisible by {k.shape[1]} key/value heads")
    if group is None or dist.get_world_size(group) == 1:
        pos = torch.arange(q.shape[2], device=q.device)
        allowed = _allowed(document_ids, document_ids, slice(None), slice(None), window, pos, pos)
        return local_attention(q, k, v, causal, scale, dropout_p, seed, allowed, sink)
    return _RingAttention.apply(q, k, v, causal, scale, dropout_p, seed, Ring(group), document_ids, window, sink)


def local_attention(q, k, v, causal: bool, scale: float, dropout_p: float = 0.0, seed: int = 0, allowed=None,
                    sink=None):
    """One-process attention through the block kernels: ``q, k [b, n, sq|sk, dk]``, ``v [b, nkv, sk, dv]``
    -> ``[b, nq, sq, dv]``. ``causal``: top-left aligned (square blocks); ``allowed`` (bool, True = may
    attend, ``[b or 1, 1, sq, sk]``) confines it further; ``sink`` as in :func:`ring_attention`."""
    out, _ = _LocalAttention.apply(q, k, v, causal, scale, dropout_p, seed, allowed, sink)
    return out


class _LocalAttention(torch.autograd.Function):
    """The one-rank case through the same kernels (so cp == 1 and cp > 1 share numerics)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, dropout_p, seed, allowed, sink):
        out, lse = block_forward(q, k, v, causal, scale, dropout_p, seed, allowed)
        if sink is not None:
            lse = merge_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, allowed, sink)
        ctx.args = (causal, scale, dropout_p, seed)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        q, k, v, out, lse, allowed, sink = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, *ctx.args, allowed)
        dsink = sink_grad(dout, out, lse, sink) if ctx.needs_input_grad[8] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, dsink
