"""The model flags a checkpoint records and a load compares (config field names, any section).

``checkpoint/arch.py`` refuses a resume whose flags differ from the checkpoint's (and
``--use-checkpoint-args`` takes them from it); ``checkpoint/format.py`` stores them in every checkpoint.
A new model flag (a field of ``config.ModelConfig`` or of a section it inherits) goes in one of these lists.
"""

SHAPE_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "max_position_embeddings", "position_embedding_type", "normalization", "swiglu", "disable_bias_linear",
    "untie_embeddings_and_output_weights", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_grouped_gemm", "moe_router_enable_expert_bias",
    "bert_no_binary_head",  # pretrain_bert.py: the binary head and token-type embeddings
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "qk_layernorm", "mtp_num_layers",
    "add_qkv_bias",
    "apply_layernorm_1p",  # not a shape, but what the stored norm weights mean: a weights-only load must match it
    "quick_geglu",  # fc1 holds [gate; linear]
    "softmax_type",  # learnable: core_attention.softmax_offset
    "attention_output_gate",  # linear_qkv holds the gate heads
    "is_hybrid_model", "hybrid_attention_ratio", "hybrid_mlp_ratio", "hybrid_override_pattern",  # hybrid Mamba
    "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
)
"""The model flags that decide parameter shapes (a weights-only load checks these too)."""

ARCHITECTURE_FLAGS = SHAPE_FLAGS + (  # + the flags that keep the shapes but change the function
    "openai_gelu", "rotary_base", "norm_epsilon", "moe_router_topk", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "yarn_correction_range_round_to_int", "bias_gelu_fusion", "spec",
    "rotary_percent", "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor",
    "window_size", "window_attn_skip_freq",
    "squared_relu", "glu_linear_offset", "activation_func_clamp_value", "qk_l2_norm",
    "rotary_interleaved", "softmax_scale", "no_rope_freq",
    "apply_residual_connection_post_layernorm",
)
"""The flags (config field names, any section) that define the model a checkpoint holds. A resume
refuses a checkpoint saved with another value of any of them, naming the flag and both values;
--finetune and --pretrained-checkpoint only those of SHAPE_FLAGS (a change of the others can be
deliberate); ``--use-checkpoint-args`` takes them all from the checkpoint. A new model flag goes
here (or in SHAPE_FLAGS when it decides a shape)."""

DERIVED_FLAGS = ("ffn_hidden_size", "num_query_groups", "kv_channels", "max_position_embeddings", "rope_type")
"""Model flags whose unset value (None) is derived from other architecture flags when the model is
built (and stored derived); a checkpoint whose config holds them unset (written by a converter) is
compared through those other flags."""
