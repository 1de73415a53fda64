"""Rotary-embedding flags of standard attention beyond --rotary-base, with Megatron-LM's names and
defaults: the part of each head that rotates (``--rotary-percent``).

:class:`RopeConfig` is mixed into the ``model`` section of the run's Config (saved with checkpoints)
and into :class:`~megatron_lite.models.transformer_config.TransformerConfig`;
:func:`check_rope_fields` validates it there with one line naming the flag and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass
class RopeConfig:
    rotary_percent: float = 1.0
    """Fraction of each head's channels that get the rotary embedding (the first ones); the rest pass through."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def partial_rotary_dim(head_dim: int, rotary_percent: float) -> int:
    """Channels of a ``head_dim`` head that rotate: Megatron's ``int(head_dim x rotary_percent)``
    below 1, the whole head at 1."""
    return int(head_dim * rotary_percent) if rotary_percent < 1.0 else head_dim


def check_rope_fields(config) -> None:
    """Validate the RopeConfig fields of a TransformerConfig (head size derived)."""
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
