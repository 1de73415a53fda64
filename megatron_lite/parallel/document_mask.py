"""Attention confined to documents: several documents (conversations) packed into one sequence.

A packed sequence carries one integer per token, its **document id** ``[b, s]``: tokens of one
document share an id and occupy consecutive positions. Attention is then *block-causal*: a query
sees the keys at or before its position with the same id, never another document's tokens. This
is the model's ``attention_mask`` argument when it is an integer tensor (a boolean
``[b, 1, s, s]`` mask, True = masked out, is the other form; ``None`` is plain causal).

Ids instead of a dense mask cost ``O(s)`` memory, not ``O(s^2)``, and split along the sequence
like the tokens, so context parallelism carries them with its keys and values: the ring passes
each block's key ids with the keys (:mod:`~megatron_lite.parallel.ring_attention`); a2a and
allgather gather them (:mod:`~megatron_lite.parallel.context`). The flash-attn path turns them into
the ``cu_seqlens`` of its variable-length kernel.
"""

from __future__ import annotations

import torch


def is_document_ids(attention_mask) -> bool:
    """True when ``attention_mask`` is the integer document-id form ``[b, s]`` (not a bool mask)."""
    return attention_mask is not None and not attention_mask.dtype == torch.bool


def document_allowed(q_ids: torch.Tensor, k_ids: torch.Tensor, q_pos=None, k_pos=None) -> torch.Tensor:
    """Bool ``[b, 1, sq, sk]``, True where query i may attend key j: same document and, when the
    positions ``q_pos [sq]`` / ``k_pos [sk]`` are given, ``k_pos[j] <= q_pos[i]`` (causal)."""
    allowed = q_ids.unsqueeze(2) == k_ids.unsqueeze(1)  # [b, sq, sk]
    if q_pos is not None:
        allowed = allowed & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))
    return allowed.unsqueeze(1)


def causal_document_mask(ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[b, 1, s, s]``, True where allowed: block-causal attention over ``ids [b, s]``."""
    pos = torch.arange(ids.shape[1], device=ids.device)
    return document_allowed(ids, ids, pos, pos)


def cu_seqlens(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(int32 cumulative lengths, longest length) of the documents of ``ids [b, s]`` read as one
    flat token stream ``b * s`` long (a document never continues into the next sample): the
    ``cu_seqlens`` / ``max_seqlen`` of flash-attn's variable-length kernel."""
    b, s = ids.shape
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.nonzero(starts.reshape(-1)).squeeze(1)
    bounds = torch.cat([first, first.new_tensor([b * s])]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())
