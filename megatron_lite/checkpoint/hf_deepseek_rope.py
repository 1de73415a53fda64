"""DeepSeek-V3 and gpt-oss rotary scaling in the Hugging Face config (``rope_parameters`` or the older
``rope_scaling``) and in our flags: plain RoPE or YaRN, transformers' table-scale rule next to ours
(:func:`~megatron_lite.models.yarn.get_mscale`); ``truncate: false`` (gpt-oss) is
``--no-yarn-correction-range-round-to-int``. What one side cannot express is refused with one
line naming the option."""

from __future__ import annotations

import math

from ..models.yarn import get_mscale
from .hf import _require


def hf_table_scale(rope: dict) -> float:
    """The factor transformers multiplies YaRN's cos/sin by (its ``attention_factor`` rule)."""
    f, mscale, all_dim = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    return get_mscale(f, mscale) / get_mscale(f, all_dim) if mscale and all_dim else get_mscale(f)


def rope_from_hf(hf: dict) -> dict:
    """Our rotary fields of a DeepSeek-V3 config (plain RoPE or YaRN), refusing what differs."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    _require(theta == int(theta), f"rope_theta {theta} cannot be expressed (--rotary-base is an integer)")
    _require(rope.get("partial_rotary_factor", 1.0) == 1.0, "partial_rotary_factor cannot be expressed (MLA rotates "
             "all qk_rope_head_dim channels)")
    out = dict(rotary_base=int(theta), rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if kind == "default":
        return dict(out, rope_type="rope")
    _require(kind == "yarn", f"rope_type {kind!r} cannot be expressed; only plain RoPE (default) and yarn")
    _require(rope.get("factor") is not None, "a yarn rope_parameters without factor cannot be expressed; give factor")
    original = rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") \
        or hf["max_position_embeddings"]
    f, all_dim, want = float(rope["factor"]), float(rope.get("mscale_all_dim") or 0.0), hf_table_scale(rope)
    # --mscale such that get_mscale(f, mscale) / get_mscale(f, all_dim) is transformers' table scale: the
    # config's mscale when that holds (transformers ignores it without mscale_all_dim), else solved for
    mscale = float(1.0 if rope.get("mscale") is None else rope["mscale"])
    if abs(get_mscale(f, mscale) / get_mscale(f, all_dim) - want) > 1e-12 * want and f > 1:
        mscale = (want * get_mscale(f, all_dim) - 1.0) / (0.1 * math.log(f))
    out.update(rope_type="yarn", rotary_scaling_factor=f, mscale=mscale, mscale_all_dim=all_dim,
               original_max_position_embeddings=int(original),
               beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
               yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))
    ours = get_mscale(f, mscale) / get_mscale(f, all_dim)
    _require(abs(ours - want) <= 1e-12 * want, f"yarn rope_parameters {rope}: transformers scales the rotary tables "
             f"by {want}, which --mscale / --mscale-all-dim cannot express with factor {f} (ours would be {ours})")
    return out


def rope_to_hf(cfg: dict) -> tuple[dict, dict | None]:
    """(``rope_parameters``, hub-style ``rope_scaling`` or None) of our rotary fields."""
    theta = float(cfg.get("rotary_base", 10000))
    f, all_dim = float(cfg.get("rotary_scaling_factor", 1.0)), float(cfg.get("mscale_all_dim", 0.0))
    if cfg.get("rope_type", "yarn") != "yarn":
        _require(get_mscale(f, all_dim) == 1.0, "--rope-type rope with --rotary-scaling-factor and --mscale-all-dim "
                 "(a softmax scale other than 1/sqrt(head size)) cannot be expressed in the deepseek_v3 format")
        return {"rope_type": "default", "rope_theta": theta}, None
    scaling = {"type": "yarn", "factor": f, "mscale": float(cfg.get("mscale", 1.0)), "mscale_all_dim": all_dim,
               "original_max_position_embeddings": int(cfg.get("original_max_position_embeddings", 4096)),
               "beta_fast": float(cfg.get("beta_fast", 32.0)), "beta_slow": float(cfg.get("beta_slow", 1.0))}
    if not cfg.get("yarn_correction_range_round_to_int", True):  # transformers' default is true
        scaling["truncate"] = False
    params = {k: v for k, v in scaling.items() if k != "type"}
    params.update(rope_type="yarn", rope_theta=theta)
    ours = get_mscale(f, scaling["mscale"]) / get_mscale(f, all_dim)
    if hf_table_scale(params) != ours:  # transformers' rule differs (mscale or mscale_all_dim 0): say it
        params["attention_factor"] = scaling["attention_factor"] = ours
    return params, scaling
