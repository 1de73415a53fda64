"""Shared pieces of the MoE tests: a small TransformerConfig with experts."""

from megatron_lite.models.transformer_config import TransformerConfig

MOE_DEFAULTS = dict(
    num_layers=2, hidden_size=16, num_attention_heads=2, add_bias_linear=False, init_method_std=0.3,
    num_experts=4, moe_ffn_hidden_size=8, moe_token_dispatcher_type="alltoall",
    ffn_hidden_size=64,  # the dense width (unused by all-MoE layers; Megatron's SwiGLU default is 0 at hidden 16)
)


def moe_config(**overrides) -> TransformerConfig:
    """TransformerConfig of a tiny MoE model (large init std, so routing has clear winners)."""
    return TransformerConfig(**{**MOE_DEFAULTS, **overrides})
