"""Sliding-window (local) attention, plugged in as the core-attention module of the layer spec.

Each query attends to itself and the ``WINDOW - 1`` keys before it (Mistral / Longformer style);
everything else (projections, rotary, tensor/sequence parallelism) is the stock model::

    python pretrain_gpt.py --spec examples/research/sliding_window.py spec ...          # every layer local
    python pretrain_gpt.py --spec examples/research/sliding_window.py local_global ...  # odd layers local

Core attention gets ``q, k, v [s, b, heads, d]`` for this rank's heads and the whole sequence (the
sequence-parallel all-gather has already happened), so the window needs no communication and is
the same at every tensor-parallel size. It is not context-parallel: ``--spec`` refuses it with
``--context-parallel-size`` > 1.
"""

from __future__ import annotations

import torch

from megatron_lite.models.attention import DotProductAttention
from megatron_lite.models.spec import LayerSpec
from megatron_lite.parallel.document_mask import document_allowed, is_document_ids

WINDOW = 8


def too_far(sq: int, sk: int, window: int, causal: bool, device=None) -> torch.Tensor:
    """Bool ``[sq, sk]``, True where query i may NOT attend key j: j after i (causal) or |i - j| >= window.
    The queries are the last ``sq`` of the ``sk`` positions (generation with a key/value cache)."""
    i = torch.arange(sq, device=device) + (sk - sq)
    distance = i[:, None] - torch.arange(sk, device=device)[None, :]
    out = distance.abs() >= window
    return out | (distance < 0) if causal else out


class SlidingWindowAttention(DotProductAttention):
    """DotProductAttention with the keys outside the window masked out (the change is this class)."""

    def __init__(self, config, state, layer_number: int, window: int = WINDOW):
        super().__init__(config, state, layer_number)
        self.window = window

    def forward(self, q, k, v, attention_mask=None, causal: bool = True):
        mask = too_far(q.shape[0], k.shape[0], self.window, causal, q.device)[None, None]  # [1, 1, sq, sk]
        if is_document_ids(attention_mask):  # packed documents: stay inside each one as well
            mask = mask | ~document_allowed(attention_mask, attention_mask)
        elif attention_mask is not None:  # bool, True = masked out
            mask = mask | attention_mask
        return super().forward(q, k, v, mask, causal=False)  # the mask already holds causality


spec = LayerSpec(core_attention=SlidingWindowAttention)
_global = LayerSpec()


def local_global(layer_number: int) -> LayerSpec:
    """Odd layers local, even layers full causal attention (Gemma-2's alternation)."""
    return spec if layer_number % 2 else _global
