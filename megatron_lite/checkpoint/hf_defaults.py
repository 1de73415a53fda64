"""What transformers' config classes read for a config.json field left out, for the fields the HF imports read.

A config.json may leave out any field of its config class: transformers then reads the class's default
(MistralConfig's 4096-token sliding window, Mixtral's and Qwen3-MoE's router_aux_loss_coef 0.001,
gpt-oss's yarn RoPE, ...), and so does the import, so that both load the same model. The sizes the weights
give (:data:`HF_SIZES`: vocab_size, hidden_size, num_hidden_layers, the heads, key/value heads and head size
where the class has a number of its own for them, the intermediate sizes, the expert count) are not filled
with a reference model's: a config.json without one is refused with one line naming the field (a KeyError
that ``load_hf`` words). A size transformers derives from others when it is absent (Llama's key/value heads:
the heads; Mistral's, Mixtral's, Qwen2's and Qwen3-MoE's head size: hidden / heads) is derived the same way.
DeepSeek-V3's tables are :data:`.hf_deepseek.HF_DEFAULTS` and :data:`.hf_deepseek.SIZES`.
"""

from __future__ import annotations

# gpt-oss reads this when config.json has neither rope_parameters nor (the older name) rope_scaling
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
HF_DEFAULTS = {  # non-size fields only
    "llama": dict(max_position_embeddings=2048),
    "mistral": dict(sliding_window=4096, max_position_embeddings=131072),
    "mixtral": dict(router_aux_loss_coef=0.001, max_position_embeddings=131072),
    "qwen2": dict(max_position_embeddings=32768, max_window_layers=28),
    "qwen3": dict(max_position_embeddings=32768),
    "qwen3_moe": dict(router_aux_loss_coef=0.001, max_position_embeddings=32768),
    "gpt_oss": dict(sliding_window=128, router_aux_loss_coef=0.001, max_position_embeddings=131072),
}
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
HF_SIZES = {  # per model_type: the fields a config.json must hold (the weights' shapes follow them)
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"),
    "llama": _SIZES,
    "mistral": _SIZES + ("num_key_value_heads",),
    "mixtral": _SIZES + ("num_key_value_heads", "num_local_experts"),
    "qwen2": _SIZES + ("num_key_value_heads",),
    "qwen3": _SIZES + ("num_key_value_heads", "head_dim"),
    "qwen3_moe": _SIZES + ("num_key_value_heads", "moe_intermediate_size", "num_experts"),
    "gpt_oss": _SIZES + ("num_key_value_heads", "head_dim", "num_local_experts"),
    "megatron-bert": _SIZES + ("max_position_embeddings", "type_vocab_size"),
}
ALIASES = {("qwen3_moe", "num_experts"): "num_local_experts"}  # the Hub's name; transformers 5 writes the other


def require_fields(hf: dict, fields, kind: str | None = None) -> None:
    """A KeyError (``load_hf``: one line naming the field) for the first of ``fields`` that ``hf`` leaves
    out (a field present with the value null counts as given: DeepSeek's q_lora_rank)."""
    for field in fields:
        if field not in hf and ALIASES.get((kind, field)) not in hf:
            raise KeyError(field)


def require_sizes(hf: dict, kind: str) -> None:
    """A KeyError naming the first size of the ``kind`` (model_type) table that ``hf`` leaves out."""
    require_fields(hf, HF_SIZES.get(kind, ()), kind)


def with_hf_defaults(hf: dict, kind: str) -> dict:
    """``hf`` with the fields it leaves out of the ``kind`` (model_type) table filled as transformers fills
    them; a size it leaves out is a KeyError naming it (:func:`require_sizes`)."""
    require_sizes(hf, kind)
    out = {**HF_DEFAULTS.get(kind, {}), **hf}
    if kind == "gpt_oss" and "rope_parameters" not in hf and "rope_scaling" not in hf:
        out["rope_parameters"] = dict(GPT_OSS_ROPE)
    return out
