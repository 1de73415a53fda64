"""The rotary scaling of the llama-style Hugging Face families (``rope_parameters``, or the older
``rope_scaling``) and our flags: ``default`` is plain RoPE, ``llama3`` is ``--use-rope-scaling``
with ``--rope-scaling-factor`` (Llama 3.1's other constants are fixed: low/high frequency factors 1
and 4, original context 8192, as in Megatron-LM), ``linear`` is
``--rotary-seq-len-interpolation-factor`` (transformers divides the frequencies by the factor, we
divide the positions: the same angles). What one side cannot express is refused in one line.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..models.rope_config import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_MAX_POSITIONS,
)

LLAMA3 = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
          "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS}


def _require(cond, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def interpolation_factor(cfg: dict):
    """--rotary-seq-len-interpolation-factor, None where it is unset or 1 (positions divided by 1: plain RoPE)."""
    factor = cfg.get("rotary_seq_len_interpolation_factor")
    return None if factor in (None, 1) else factor


def rope_scaling_to_hf(cfg: dict, theta: float) -> tuple[dict, dict | None]:
    """(``rope_parameters``, hub-style ``rope_scaling`` or None) of a flat config."""
    factor, scaling = interpolation_factor(cfg), cfg.get("use_rope_scaling")
    _require(not (scaling and factor), "--use-rope-scaling with --rotary-seq-len-interpolation-factor cannot be "
             "expressed in the Hugging Face llama formats (one rope_type each)")
    if scaling:
        extra = {"rope_type": "llama3", "factor": float(cfg.get("rope_scaling_factor", 8.0)), **LLAMA3}
    elif factor:
        extra = {"rope_type": "linear", "factor": float(factor)}
    else:
        return {"rope_type": "default", "rope_theta": theta}, None
    return {**extra, "rope_theta": theta}, extra


def rope_scaling_from_hf(rope: dict) -> dict:
    """Our rotary scaling flags of a ``rope_parameters`` / ``rope_scaling`` dict (checked)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    _require(kind in ("default", "llama3", "linear"), f"rope_type {kind!r} (RoPE scaling) cannot be expressed; "
             "plain RoPE, llama3 (--use-rope-scaling) or linear (--rotary-seq-len-interpolation-factor) only")
    if kind == "default":
        return {}
    factor = float(rope["factor"])
    if kind == "linear":
        _require(factor == int(factor) and factor >= 1, f"rope_type linear with factor {factor} cannot be expressed "
                 "(--rotary-seq-len-interpolation-factor is an integer of at least 1)")
        return {"rotary_seq_len_interpolation_factor": int(factor)}
    for key, want in LLAMA3.items():
        _require(float(rope.get(key, want)) == want, f"rope_type llama3 with {key} {rope.get(key)} cannot be expressed "
                 f"(Megatron-LM's --use-rope-scaling fixes it at {want:g})")
    return {"use_rope_scaling": True, "rope_scaling_factor": factor}
