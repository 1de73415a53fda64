"""Sliding-window attention masks (``--window-size LEFT RIGHT``), built from global token positions.

A window ``(left, right)`` lets the query at position ``i`` see the keys at positions ``j`` with
``i - left <= j <= i + right``; ``-1`` leaves that side unbounded (flash-attn's and Megatron-LM's
convention). Causal attention adds ``j <= i``, so a causal model's ``right`` has no effect (use 0).
A query always sees its own key, so no row of a window is empty.

Every attention path builds its window from positions, never from local indices: the one-process
core attention (queries bottom-right aligned with the keys, as with a key/value cache), the
key/value caches (each row's own positions, :func:`cache_window_mask`), and context parallelism,
whose ranks hold load-balanced chunks of the sequence (ring attention passes each block the global
positions of its queries and keys; all-gather and Ulysses attention the gathered ones).
"""

from __future__ import annotations

import torch


def window_allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window) -> torch.Tensor:
    """Bool ``[..., sq, sk]``, True where the query at ``q_pos [..., sq]`` may see the key at
    ``k_pos [sk]`` under ``window = (left, right)`` (no causal part)."""
    left, right = window
    diff = q_pos.unsqueeze(-1) - k_pos  # query position - key position
    allowed = torch.ones(diff.shape, dtype=torch.bool, device=diff.device)
    if left >= 0:
        allowed &= diff <= left
    if right >= 0:
        allowed &= -diff <= right
    return allowed


def confine_to_window(mask, window, causal: bool, sq: int, sk: int, device):
    """``mask`` (bool, True = may attend, or None for plain causal / full attention) confined to
    ``window``; the ``sq`` queries are the last ``sq`` of the ``sk`` positions (bottom-right aligned).
    Returns a bool mask broadcastable to ``[b, heads, sq, sk]``. Each query keeps its own key, also
    where ``mask`` hides it (a BERT padding query, whose window may hold only padding keys: a row
    with no key would be NaN and spread through the values of later layers)."""
    q_pos, k_pos = torch.arange(sk - sq, sk, device=device), torch.arange(sk, device=device)
    band = window_allowed(q_pos, k_pos, window)
    if mask is None and causal:
        band &= k_pos <= q_pos.unsqueeze(-1)
    return band.view(1, 1, sq, sk) if mask is None else (mask & band) | (k_pos == q_pos.unsqueeze(-1))


def cache_window_mask(context, mask, window, sq: int, sk: int, device):
    """The attention mask (True = masked out) of ``sq`` new queries over ``sk`` cached keys under
    ``window``: ``context.query_positions(sq)`` ``[b or 1, sq]`` are the queries' positions in their
    rows (key ``j`` sits at position ``context.first_key + j``); causal, and ``mask`` (the cache's own,
    or None) kept."""
    if window is None:
        return mask
    q_pos = context.query_positions(sq).to(device)
    k_pos = torch.arange(context.first_key, context.first_key + sk, device=device)
    masked = ~(window_allowed(q_pos, k_pos, window) & (k_pos <= q_pos.unsqueeze(-1)))
    masked = masked.unsqueeze(-3)  # [b or 1, 1, sq, sk]
    return masked if mask is None else mask | masked


def chunk_positions(local_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens of ring rank ``rank`` of ``size`` (load-balanced:
    chunks ``rank`` and ``2 size - 1 - rank`` of ``2 size``); ``arange`` for one rank."""
    half = local_len // 2
    first, second = rank * half, (2 * size - 1 - rank) * half
    return torch.cat([torch.arange(first, first + half, device=device),
                      torch.arange(second, second + local_len - half, device=device)])
