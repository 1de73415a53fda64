"""Rotary-embedding flags of standard attention beyond --rotary-base, with Megatron-LM's names and
defaults: the part of each head that rotates (``--rotary-percent``), Llama 3.1's frequency scaling
(``--use-rope-scaling``, ``--rope-scaling-factor``; Megatron fixes its other constants: low/high
frequency factors 1 and 4, original context 8192) and linear position interpolation
(``--rotary-seq-len-interpolation-factor``: positions divided by the factor).

:class:`RopeConfig` is mixed into the ``model`` section of the run's Config (saved with checkpoints)
and into :class:`~megatron_lite.models.transformer_config.TransformerConfig`;
:func:`check_rope_fields` validates it there with one line naming the flag and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass
class RopeConfig:
    rotary_percent: float = 1.0
    """Fraction of each head's channels that get the rotary embedding (the first ones); the rest pass through."""
    rotary_seq_len_interpolation_factor: int | None = None
    """Linear position interpolation: rotary positions are divided by this factor (default: none)."""
    use_rope_scaling: bool = False
    """Llama 3.1's rotary frequency scaling (low/high frequency factors 1 and 4, original context 8192)."""
    rope_scaling_factor: float = 8.0
    """With --use-rope-scaling: the factor low frequencies are divided by."""


# Llama 3.1's constants, fixed in Megatron-LM (and in Llama 3.1 / 3.2's Hugging Face configs)
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_MAX_POSITIONS = 1.0, 4.0, 8192


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's scaled frequencies: a channel whose wavelength (2 pi / f) is shorter than
    original context / high factor keeps f, one longer than original context / low factor gets
    f / factor, and in between f is blended linearly in (original context / wavelength)."""
    wavelength = 2 * math.pi / inv_freq
    ctx = LLAMA3_ORIGINAL_MAX_POSITIONS
    blend = (ctx / wavelength - LLAMA3_LOW_FREQ_FACTOR) / (LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    mixed = (1 - blend) * inv_freq / factor + blend * inv_freq
    out = torch.where(wavelength > ctx / LLAMA3_LOW_FREQ_FACTOR, inv_freq / factor, mixed)
    return torch.where(wavelength < ctx / LLAMA3_HIGH_FREQ_FACTOR, inv_freq, out)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def partial_rotary_dim(head_dim: int, rotary_percent: float) -> int:
    """Channels of a ``head_dim`` head that rotate: Megatron's ``int(head_dim x rotary_percent)``
    below 1, the whole head at 1."""
    return int(head_dim * rotary_percent) if rotary_percent < 1.0 else head_dim


def check_rope_fields(config) -> None:
    """Validate the RopeConfig fields of a TransformerConfig (head size derived)."""
    _check_scaling(config)
    p = config.rotary_percent
    _require(0.0 < p <= 1.0, f"--rotary-percent must be in (0, 1], got {p}")
    if p == 1.0:
        return
    _require(config.position_embedding_type == "rope",
             f"--rotary-percent {p} needs --position-embedding-type rope (it sets how much of each head rotates)")
    _require(not config.multi_latent_attention, f"--rotary-percent {p} does not apply to --multi-latent-attention "
             "(MLA rotates its own --qk-pos-emb-head-dim channels); drop --rotary-percent")
    dim = partial_rotary_dim(config.kv_channels, p)
    _require(dim >= 2 and dim % 2 == 0, f"--rotary-percent {p} of head size {config.kv_channels} gives {dim} rotary "
             "channels; it must give an even number of at least 2 (rotary pairs)")


def _check_scaling(config) -> None:
    factor = config.rotary_seq_len_interpolation_factor
    _require(factor is None or factor >= 1, f"--rotary-seq-len-interpolation-factor must be at least 1, got {factor}")
    _require(config.rope_scaling_factor > 0, f"--rope-scaling-factor must be positive, got {config.rope_scaling_factor}")
    for flag, on in (("--use-rope-scaling", config.use_rope_scaling),
                     ("--rotary-seq-len-interpolation-factor", factor is not None)):
        if not on:
            continue
        _require(config.position_embedding_type == "rope", f"{flag} needs --position-embedding-type rope")
        _require(not config.multi_latent_attention, f"{flag} does not apply to --multi-latent-attention (its rotary "
                 "part is scaled by --rope-type yarn); drop it")
