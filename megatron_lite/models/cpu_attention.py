"""Core attention on the CPU, as one autograd function, with or without attention dropout.

With attention dropout, PyTorch's CPU ``scaled_dot_product_attention`` cannot use its flash kernel
and runs its composite math path: the scores, a float mask for causality, a "safe" softmax that
also checks every row for being fully masked, a Bernoulli draw in the scores' dtype, and autograd
of each piece (about 300 ms forward + backward for 4 x 12 heads of 512 causal tokens on a 2-core
machine). :func:`cpu_core_attention` computes the same function in fewer passes over the scores
(about 190 ms there). Without dropout, SDPA's flash kernel applies, but in bf16 on a CPU with
AVX512-BF16 and no AMX it is slower than this function for causal attention (forward + backward of
12 heads, 2048 tokens a batch, 2 cores: 30 / 40 / 62 ms against SDPA's 54 / 89 / 100 ms at 256 /
512 / 1024 tokens; at 2048, 149 against 161 ms for 6x SDPA's saved memory), so up to ``MAX_KEYS``
keys :func:`beats_cpu_sdpa` sends those calls here too (with AMX, not measured, SDPA stays). The
cost: this function keeps each block's probabilities for the backward (about ``5/8 s^2`` 16-bit
values per head and sequence in 4 blocks), where the flash kernel keeps one log-sum-exp per row.

* forward: ``scores = q k^T scale``, the causal or given mask written into the scores in place, one
  softmax, with dropout the one-byte 0/1 keep mask (a quarter of a float mask's bytes) drawn by
  ``fusions.dropout.keep_mask`` from the current generator (i.e. the tracker's tensor-parallel one),
  ``out = (probs * keep) v / (1 - p)``;
* backward: the saved probabilities and keep mask give ``d(probs) = (dout v^T) / (1 - p) * keep``,
  one softmax backward, and the three products (``dk`` and ``dv`` accumulated block by block in
  place); nothing else is saved;
* every scale (``scale``, ``1 / (1 - p)``) is the ``alpha`` of a batched product
  (``torch.baddbmm``): applied to its fp32 accumulator before the one rounding, with no pass of its
  own;
* causal attention of ``2 * BLOCK_ROWS`` or more queries runs in up to 4 query blocks, each only
  up to its last key (:func:`query_blocks`): most scores above the diagonal are never computed,
  normalised or drawn. The keep mask is drawn block by block, in order.

Grouped-query attention multiplies each key/value head with its group of query heads in one
batched product (no repeated keys or values). 16-bit inputs: on a CPU that computes that dtype in
hardware (AVX512-BF16/FP16 or AMX) the products stay 16-bit (fp32 accumulation inside the GEMM,
the softmax computed in fp32 and stored 16-bit, as fused GPU attention does); elsewhere they are
computed in fp32, as SDPA's math path does on the CPU. Rows whose every key is masked get zero
probabilities (SDPA's rule), not NaN.
"""

from __future__ import annotations

import functools

import torch

from ..device import cpu_has_amx, cpu_has_native
from ..fusions.dropout import keep_mask
from ..inference.kv_cache import causal_mask_with_offset

BLOCK_ROWS = 128  # causal attention: queries per block at least this (query_blocks)
MAX_KEYS = 1024  # without dropout, beats_cpu_sdpa: keys per query at most this


@functools.cache
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the attention computes in for inputs of ``dtype``: itself when fp32 or native on this CPU."""
    return dtype if dtype == torch.float32 or cpu_has_native(dtype) else torch.float32


def beats_cpu_sdpa(q: torch.Tensor, k: torch.Tensor, allowed, causal: bool) -> bool:
    """Whether attention without dropout is faster here than through SDPA's CPU kernel (module docstring):
    causal with no explicit mask (``allowed`` None), at most ``MAX_KEYS`` keys (``k [b, nkv, sk, d]``),
    in a 16-bit dtype this CPU computes in hardware with AVX-512 but no AMX (measured there; with AMX,
    SDPA's kernel has matrix units too and stays). fp32 stays with SDPA (about as fast, less memory)."""
    return (causal and allowed is None and q.dtype != torch.float32 and compute_dtype(q.dtype) == q.dtype
            and not cpu_has_amx() and k.shape[2] <= MAX_KEYS)


@torch._disable_dynamo  # torch.compiler.disable, Dynamo imported at the first call (not at start-up)
# inside a compiled layer it runs as it is (Dynamo would split it into many graphs)
def cpu_core_attention(q, k, v, masked, causal: bool, dropout_p: float, scale: float, sink=None) -> torch.Tensor:
    """``softmax(q k^T scale + mask)`` with dropout ``dropout_p``, times ``v``.

    ``q [b, nq, sq, d]``, ``k [b, nkv, sk, d]``, ``v [b, nkv, sk, dv]`` (``nq % nkv == 0``); ``masked``
    None or bool broadcastable to ``[b, nq, sq, sk]`` (True = masked out, batch and head dims 1 or
    full); ``causal`` (used when ``masked`` is None) is bottom-right aligned when ``sk > sq``.
    Returns ``[b, nq, sq, dv]`` in ``q``'s dtype, computed in :func:`compute_dtype` of it. ``sink``
    (fp32 ``[nq]`` or None): each head's sink logit, in the softmax's denominator only."""
    return _CoreAttention.apply(q, k, v, masked, causal, dropout_p, scale, compute_dtype(q.dtype), sink)


def _grouped(t: torch.Tensor, nkv: int, dtype: torch.dtype) -> torch.Tensor:
    """``[b, heads, s, d]`` -> a new ``[b * nkv, heads / nkv * s, d]`` (``dtype``): a key/value head's
    query heads stacked along the sequence, so one batched product serves the group. Always a copy, in
    one pass: a view would keep the whole fused QKV output alive for backward."""
    b, heads, s, d = t.shape
    out = torch.empty(b * nkv, heads // nkv * s, d, dtype=dtype, device=t.device)
    out.view(b, nkv, heads // nkv, s, d).copy_(t.reshape(b, nkv, heads // nkv, s, d))
    return out


def _scaled_bmm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(a @ b) * alpha`` with ``alpha`` applied to the product's accumulator (``baddbmm`` ignores its
    input at ``beta=0``): no pass over the product, one rounding."""
    return torch.baddbmm(a.new_zeros(()), a, b, beta=0, alpha=alpha)


def _mask_view(masked: torch.Tensor, nkv: int, group: int) -> torch.Tensor:
    """A ``[B, H, sq, sk]`` mask (H 1 or nq) viewed to broadcast over ``[b, nkv, group, sq, sk]``."""
    bm, hm, sq, sk = masked.shape
    if hm == 1:
        return masked.reshape(bm, 1, 1, sq, sk)
    return masked.reshape(bm, nkv, group, sq, sk)


def query_blocks(sq: int, sk: int, causal: bool) -> list[tuple[int, int, int]]:
    """``(first query, end query, end key)`` per block of queries. Causal attention with at least
    ``2 * BLOCK_ROWS`` queries is cut into up to 4 blocks, each seeing only the keys up to its last
    query (bottom-right aligned), so most scores above the diagonal are never computed."""
    n = min(4, sq // BLOCK_ROWS) if causal else 1
    if n <= 1:
        return [(0, sq, sk)]
    edges = [sq * i // n for i in range(n + 1)]
    return [(lo, hi, hi + sk - sq) for lo, hi in zip(edges, edges[1:])]


def _rows(t3: torch.Tensor, group: int, sq: int, lo: int, hi: int) -> torch.Tensor:
    """Queries ``lo:hi`` of each head of a group: ``[bh, group * sq, x] -> [bh, group * (hi - lo), x]``."""
    if group == 1:
        return t3[:, lo:hi]
    bh, _, x = t3.shape
    return t3.view(bh, group, sq, x)[:, :, lo:hi].reshape(bh, group * (hi - lo), x)


def _put_rows(t3: torch.Tensor, part: torch.Tensor, group: int, sq: int, lo: int, hi: int) -> None:
    bh, _, x = t3.shape
    t3.view(bh, group, sq, x)[:, :, lo:hi] = part.view(bh, group, hi - lo, x)


def _dropped(probs: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The probabilities with the dropped entries zeroed (unscaled), or themselves without dropout."""
    return probs if keep is None else probs * keep


class _CoreAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, masked, causal, p, scale, dtype, sink):
        b, nq, sq, d = q.shape
        nkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
        group = nq // nkv
        q3, k3, v3 = _grouped(q, nkv, dtype), _grouped(k, nkv, dtype), _grouped(v, nkv, dtype)
        blocks = query_blocks(sq, sk, causal and masked is None)
        mask5 = empty_rows = None
        if masked is not None:  # one block
            mask5 = _mask_view(masked, nkv, group)
            empty_rows = mask5.all(dim=-1, keepdim=True)
            empty_rows = empty_rows if bool(empty_rows.any()) else None
        out = torch.empty(b * nkv, group * sq, dv, dtype=dtype, device=q.device)
        saved = []
        for lo, hi, kend in blocks:
            scores = _scaled_bmm(_rows(q3, group, sq, lo, hi), k3[:, :kend].transpose(1, 2), scale)
            scores5 = scores.view(b, nkv, group, hi - lo, kend)
            if mask5 is not None:
                scores5.masked_fill_(mask5, float("-inf"))
            elif causal:  # a block is itself bottom-right aligned: its last query sees key kend - 1,
                # so only its last hi - lo keys hold masked entries (all when there are fewer keys)
                width = min(hi - lo, kend)
                scores5[..., kend - width:].masked_fill_(causal_mask_with_offset(hi - lo, width, q.device), float("-inf"))
            lse = None
            if sink is None:
                probs = torch.softmax(scores, dim=-1)
            else:  # exp(s - L), L = logaddexp(logsumexp(s), sink): the sink takes its share of every row
                lse = torch.logaddexp(torch.logsumexp(scores5, dim=-1).float(), sink.view(1, nkv, group, 1))
                probs = torch.exp(scores5 - lse.unsqueeze(-1).to(dtype)).view_as(scores)
            del scores, scores5
            if empty_rows is not None:  # softmax of a fully masked row is NaN; SDPA gives zeros
                probs.view(b, nkv, group, sq, sk).masked_fill_(empty_rows, 0.0)
            keep = keep_mask(probs.shape, p) if p > 0 else None
            _put_rows(out, _scaled_bmm(_dropped(probs, keep), v3[:, :kend], 1.0 / (1.0 - p)), group, sq, lo, hi)
            saved += [probs, keep, lse]
        ctx.save_for_backward(q3, k3, v3, sink, *saved)
        ctx.blocks = blocks
        ctx.shapes, ctx.dtypes = (b, nq, nkv, sq, sk, d, dv, p, scale), (q.dtype, k.dtype, v.dtype)
        return out.view(b, nq, sq, dv).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q3, k3, v3, sink, *saved = ctx.saved_tensors
        b, nq, nkv, sq, sk, d, dv, p, scale = ctx.shapes
        group = nq // nkv
        do3, keep_scale = _grouped(dout, nkv, q3.dtype), 1.0 / (1.0 - p)
        dq3, dk3, dv3 = torch.empty_like(q3), torch.zeros_like(k3), torch.zeros_like(v3)
        dsink = None if sink is None else torch.zeros(nkv, group, device=q3.device)
        for (lo, hi, kend), probs, keep, lse in zip(ctx.blocks, saved[0::3], saved[1::3], saved[2::3]):
            do_rows = _rows(do3, group, sq, lo, hi)
            dv3[:, :kend].baddbmm_(_dropped(probs, keep).transpose(1, 2), do_rows, alpha=keep_scale)
            dprobs = _scaled_bmm(do_rows, v3[:, :kend].transpose(1, 2), keep_scale)
            if keep is not None:
                dprobs.mul_(keep)
            dscores = torch._softmax_backward_data(dprobs, probs, -1, probs.dtype)  # exact with the sink too
            if dsink is not None:  # d sink = -exp(sink - L) * sum_j p_j dp_j, summed over the rows
                row = (probs * dprobs).sum(-1).view(b, nkv, group, hi - lo).float()
                dsink -= (torch.exp(sink.view(1, nkv, group, 1) - lse) * row).sum((0, 3))
            del dprobs
            _put_rows(dq3, _scaled_bmm(dscores, k3[:, :kend], scale), group, sq, lo, hi)
            dk3[:, :kend].baddbmm_(dscores.transpose(1, 2), _rows(q3, group, sq, lo, hi), alpha=scale)
        qt, kt, vt = ctx.dtypes
        return (dq3.view(b, nq, sq, d).to(qt), dk3.view(b, nkv, sk, d).to(kt), dv3.view(b, nkv, sk, dv).to(vt),
                None, None, None, None, None, None if dsink is None else dsink.reshape(nq))
