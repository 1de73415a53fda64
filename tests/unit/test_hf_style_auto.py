"""docs/checkpoints.md and docs/deepseek-v3.md: which format `--hf-style auto` picks for a model."""

import pytest

from megatron_lite.checkpoint.hf import pick_style

ROPE = {"position_embedding_type": "rope"}


@pytest.mark.parametrize("cfg, style", [
    ({}, "gpt2"),  # learned positions
    (ROPE, "llama"),
    ({**ROPE, "add_qkv_bias": True, "disable_bias_linear": True}, "qwen2"),
    ({**ROPE, "add_qkv_bias": True}, "llama"),  # biases everywhere: llama's attention_bias + mlp_bias
    ({**ROPE, "qk_layernorm": True}, "qwen3"),
    ({**ROPE, "window_size": [3, 0]}, "mistral"),
    ({**ROPE, "num_experts": 4}, "mixtral"),
    ({**ROPE, "num_experts": 4, "qk_layernorm": True}, "qwen3_moe"),
    ({**ROPE, "num_experts": 4, "quick_geglu": True}, "gpt_oss"),
    ({**ROPE, "num_experts": 4, "softmax_type": "learnable"}, "gpt_oss"),
    ({**ROPE, "multi_latent_attention": True}, "deepseek_v3"),
    ({**ROPE, "mtp_num_layers": 1}, "deepseek_v3"),
    ({"bert_no_binary_head": False}, "bert"),
])
def test_auto_picks_the_documented_format(cfg, style):
    assert pick_style(cfg) == style
