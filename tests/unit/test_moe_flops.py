"""FLOPs of an MoE GPT count the active parameters: router + top-k experts + shared experts."""

from types import SimpleNamespace

from megatron_lite.moe.config import MoEConfig
from megatron_lite.perf.flops import num_floating_point_operations

MODEL = SimpleNamespace(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16,
                        ffn_hidden_size=32, swiglu=True)


def test_one_expert_top1_is_the_dense_model_plus_its_router():
    moe = MoEConfig(num_experts=1, moe_router_topk=1, moe_ffn_hidden_size=32)
    dense = num_floating_point_operations(MODEL, 3)
    tokens = 3 * 4
    assert num_floating_point_operations(MODEL, 3, moe_config=moe) == dense + 3 * 2 * (2 * tokens * 8 * 1)


def test_top2_experts_shared_experts_and_dense_layers_by_hand():
    moe = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq="([0,1])",
                    moe_shared_expert_intermediate_size=8)
    b, t, h = 1, 4, 8
    attention = 2 * t * h * 8 + 2 * 2 * t * h * 8 + 2 * 2 * t * 4 * 8 + 2 * t * 8 * h  # a*d = g*d = 8
    dense_mlp = 2 * t * h * 32 * 2 + 2 * t * 32 * h
    experts = 2 * (2 * t * h * 16 * 2 + 2 * t * 16 * h)
    shared = 2 * t * h * 8 * 2 + 2 * t * 8 * h
    router = 2 * t * h * 4
    logits = 2 * t * h * 16
    expected = 3 * (2 * attention + dense_mlp + router + experts + shared) + 3 * logits
    assert num_floating_point_operations(MODEL, b, moe_config=moe) == expected
    assert num_floating_point_operations(MODEL, b, moe_config=MoEConfig()) == num_floating_point_operations(MODEL, b)
