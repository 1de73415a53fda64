"""What transformers' config classes read for a config.json field left out, for the fields the HF imports read.

A config.json may leave out any field of its config class: transformers then reads the class's default
(MistralConfig's 4096-token sliding window, Mixtral's and Qwen3-MoE's router_aux_loss_coef 0.001,
gpt-oss's yarn RoPE, ...), and so does the import, so that both load the same model. The sizes the weights
give (vocab_size, hidden_size, num_hidden_layers, ...) are not filled: a config.json without one is refused
with one line naming the field (``load_hf``). DeepSeek-V3's table is :data:`.hf_deepseek.HF_DEFAULTS`.
"""

from __future__ import annotations

# gpt-oss reads this when config.json has neither rope_parameters nor (the older name) rope_scaling
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
HF_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048),
    "mistral": dict(num_key_value_heads=8, sliding_window=4096, max_position_embeddings=131072),
    "mixtral": dict(num_key_value_heads=8, router_aux_loss_coef=0.001, max_position_embeddings=131072),
    "qwen2": dict(num_key_value_heads=32, max_position_embeddings=32768, max_window_layers=28),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768),
    "qwen3_moe": dict(num_key_value_heads=4, router_aux_loss_coef=0.001, max_position_embeddings=32768,
                      num_local_experts=128),
    "gpt_oss": dict(num_key_value_heads=8, head_dim=64, sliding_window=128, router_aux_loss_coef=0.001,
                    max_position_embeddings=131072),
}


def with_hf_defaults(hf: dict, kind: str) -> dict:
    """``hf`` with the fields it leaves out of the ``kind`` (model_type) table filled as transformers fills them."""
    out = {**HF_DEFAULTS.get(kind, {}), **hf}
    if kind == "gpt_oss" and "rope_parameters" not in hf and "rope_scaling" not in hf:
        out["rope_parameters"] = dict(GPT_OSS_ROPE)
    return out
