"""Rotary tables of a model: plain RoPE, or YaRN scaling (``--rope-type yarn``) of MLA's rotary part or
of a standard attention's rotary channels (gpt-oss).

YaRN (Peng et al. 2023, as Megatron-LM and DeepSeek-V3 implement it), over ``d`` rotary channels
with base ``b``, factor ``f`` and the pretraining context ``L0``:

* ``extra_i = b^(-2i/d)`` (the original frequencies) and ``inter_i = extra_i / f`` (interpolated);
* the correction range: ``dim(beta) = d ln(L0 / (2 pi beta)) / (2 ln b)``, ``low = floor(dim(beta_fast))``,
  ``high = ceil(dim(beta_slow))`` (not rounded with ``--no-yarn-correction-range-round-to-int``, as
  gpt-oss), clamped to ``[0, d - 1]``; ``ramp_i = clamp((i - low) / (high - low), 0, 1)``
  (``high`` is nudged by 0.001 when equal to ``low``);
* ``inv_freq_i = inter_i ramp_i + extra_i (1 - ramp_i)``: fast-rotating channels keep their
  frequency, slow ones are interpolated, always (whatever the sequence length);
* cos and sin are multiplied by ``get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)`` with
  ``get_mscale(f, m) = 1 if f <= 1 else 0.1 m ln f + 1``; MLA's softmax scale is
  ``get_mscale(f, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``
  (:func:`mla_softmax_scale`).

For DeepSeek-V3 (d 64, b 10000, f 40, L0 4096, betas 32 / 1, mscale = mscale_all_dim = 1): low 10,
high 23, table factor 1, softmax scale 1.368888^2 / sqrt(192) = 0.135234.
"""

from __future__ import annotations

import math

import torch

from .common import rotary_cos_sin
from .rope_config import llama3_inv_freq, partial_rotary_dim


def get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def correction_range(dim: int, base: float, original_max_positions: int, beta_fast: float,
                     beta_slow: float, round_to_int: bool = True) -> tuple[float, float]:
    """(low, high) channel-pair indices of the YaRN ramp (fractional without ``round_to_int``)."""
    def channel(rotations):
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = channel(beta_fast), channel(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, factor: float, original_max_positions: int, beta_fast: float,
                  beta_slow: float, round_to_int: bool = True) -> torch.Tensor:
    """The YaRN inverse frequencies ``[dim / 2]`` (fp32)."""
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low, high = correction_range(dim, base, original_max_positions, beta_fast, beta_slow, round_to_int)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return extra / factor * ramp + extra * (1 - ramp)


def mla_softmax_scale(config) -> float:
    """MLA's attention scale (Megatron computes it this way whatever --rope-type is)."""
    m = get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return m * m / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def rotary_dim(config) -> int:
    """Channels the rotary tables cover: MLA's rotary part, else the first ``--rotary-percent`` of the head."""
    if getattr(config, "multi_latent_attention", False):
        return config.qk_pos_emb_head_dim
    return partial_rotary_dim(config.head_dim, getattr(config, "rotary_percent", 1.0))


def rotary_tables(config, position_ids: torch.Tensor):
    """(cos, sin) ``[s, b, 1, rotary_dim]`` (fp32) for ``position_ids [b, s]``: YaRN-scaled with
    ``--rope-type yarn``, plain RoPE otherwise."""
    dim = rotary_dim(config)
    if getattr(config, "rope_type", "rope") != "yarn":
        return scaled_rotary_tables(config, position_ids, dim)
    f = config.rotary_scaling_factor
    inv_freq = yarn_inv_freq(dim, config.rotary_base, f, config.original_max_position_embeddings,
                             config.beta_fast, config.beta_slow, getattr(config, "yarn_correction_range_round_to_int", True))
    mscale = get_mscale(f, config.mscale) / get_mscale(f, config.mscale_all_dim)
    return rotary_cos_sin(position_ids, dim, config.rotary_base, inv_freq=inv_freq, mscale=mscale)


def scaled_rotary_tables(config, position_ids: torch.Tensor, dim: int):
    """Plain RoPE tables over ``dim`` channels, with Llama 3.1's frequency scaling (--use-rope-scaling)
    and positions divided by --rotary-seq-len-interpolation-factor where asked."""
    inv_freq = 1.0 / (config.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if getattr(config, "use_rope_scaling", False):
        inv_freq = llama3_inv_freq(inv_freq, config.rope_scaling_factor)
    factor = getattr(config, "rotary_seq_len_interpolation_factor", None)
    if factor is not None and factor != 1:
        position_ids = position_ids.float() / factor
    return rotary_cos_sin(position_ids, dim, config.rotary_base, inv_freq=inv_freq)
