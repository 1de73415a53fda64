"""Shared pieces of the MoE tests: a layer config carrying the transformer-config field names."""

from types import SimpleNamespace

import torch

from megatron_lite.models.common import seeded_init

MOE_DEFAULTS = dict(
    num_layers=2, hidden_size=16, swiglu=False, add_bias_linear=False, params_dtype=torch.float32,
    sequence_parallel=False, tensor_model_parallel_size=1, seed=1234, init_method_std=0.3,
    num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2, moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_input_jitter_eps=None, moe_router_score_function="softmax",
    moe_router_pre_softmax=False, moe_router_topk_scaling_factor=None, moe_router_num_groups=None,
    moe_router_group_topk=None, moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3,
    moe_router_dtype=None, moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=None,
    moe_pad_expert_input_to_capacity=False, moe_token_drop_policy="probs", moe_grouped_gemm=False,
    moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, expert_model_parallel_size=1,
    expert_tensor_parallel_size=None,
)


def moe_config(**overrides):
    """A namespace with the MoE layer's config fields; ``init_method`` seeds by (seed, layer, name)."""
    config = SimpleNamespace(**{**MOE_DEFAULTS, **overrides})

    def init_method(layer_number, name, scaled=False):
        return seeded_init(config.seed, layer_number, name, config.init_method_std,
                           config.num_layers if scaled else None)

    config.init_method = init_method
    return config
