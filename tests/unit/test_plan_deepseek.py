"""The layout planner on DeepSeek-V3-shaped models: multi-latent attention, shared experts, dense first
layers, multi-token prediction and uneven pipeline stages.

Parameter counts equal built models' (every stage, at TP2 + SP and EP2 too); the FLOPs are
perf/flops.py's and equal 2 x tokens x the active matmul parameters plus core attention; the
preset is DeepSeek-V3's 671B total / 37B active; MLA's activation formula reduces to Korthikanti's
for a multi-head shape; memory and traffic count the MTP layers on the last stage and MLA's own
tensor-parallel and context-parallel transfers."""

import dataclasses
import os
import sys

import pytest

from megatron_lite.errors import ConfigError
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.state import ParallelState
from megatron_lite.perf.activation_memory import korthikanti_layer_bytes, mla_layer_bytes
from megatron_lite.perf.comm_volume import ring_bytes
from megatron_lite.perf.flops import core_attention_flops, num_floating_point_operations
from megatron_lite.perf.plan import (
    MODEL_PRESETS,
    ClusterSpec,
    Layout,
    ModelSpec,
    active_params,
    check_layout,
    estimate,
    stage_layers,
    stage_params,
    volumes,
)
from megatron_lite.perf.plan.estimate import step_flops
from tests.harness import cached_state, run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tools import plan as plan_tool  # noqa: E402

GB = 2**30
SHAPES = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100, ffn_hidden_size=48,
              swiglu=True, add_bias_linear=False, normalization="RMSNorm", untie_embeddings_and_output_weights=True,
              kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
VARIANTS = {  # ModelSpec fields beyond SHAPES; the TransformerConfig gets the same names
    "dsv3": dict(q_lora_rank=16, qk_layernorm=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                 moe_shared_expert_intermediate_size=16, moe_layer_freq="([0]+[1]*3)", mtp_num_layers=1),
    "noq": dict(q_lora_rank=None, normalization="LayerNorm", untie_embeddings_and_output_weights=False,
                mtp_num_layers=2),
}


def _spec(variant):
    return ModelSpec(**{**SHAPES, **VARIANTS[variant], "multi_latent_attention": True, "learned_positions": False})


def _config(variant, **run):
    fields = {k: v for k, v in {**SHAPES, **VARIANTS[variant]}.items() if k != "add_bias_linear"}
    return TransformerConfig(max_position_embeddings=16, position_embedding_type="rope", add_bias_linear=False,
                             multi_latent_attention=True, **fields, **run)


# (pp, stage, first layer, end layer); PP3 over 4 layers: 1, 2, 1 layers
STAGES = [(1, 0, 0, 4), (2, 0, 0, 2), (2, 1, 2, 4), (3, 0, 0, 1), (3, 1, 1, 3), (3, 2, 3, 4)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stage_parameters_equal_a_built_model(variant):
    spec, config = _spec(variant), _config(variant)
    for pp, stage, lo, hi in STAGES:
        first, last = stage == 0, stage == pp - 1
        model = GPTModel(config, ParallelState(), pre_process=first, post_process=last, layer_start=lo, layer_end=hi)
        assert sum(stage_params(spec, 1, pp, 1, first, last, stage)) == model.num_parameters(), (pp, stage)


def _rank_parameters(variant, tp, ep):
    state = cached_state(tp=tp, ep=ep)
    model = GPTModel(_config(variant, tensor_model_parallel_size=tp, sequence_parallel=tp > 1), state)
    return model.num_parameters()


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_tp_and_ep_shards_equal_a_built_model(tp, ep):
    """TP2 + SP: MLA's down projections and latent norms whole on each rank; EP2: half the experts each."""
    held = run_ranks(2, _rank_parameters, "dsv3", tp, ep)
    assert held[0] == held[1] == sum(stage_params(_spec("dsv3"), tp, 1, ep, True, True))


def _matmul_params(spec):
    """Active parameters that multiply (the input embedding and the norms left out)."""
    h, norm = spec.hidden_size, spec.norm_params
    latent_norms = (spec.kv_lora_rank + (spec.q_lora_rank or 0)) * norm // h if spec.qk_layernorm else 0
    norms = spec.num_layers * (2 * norm + latent_norms) + norm
    table = spec.padded_vocab(1) * h
    return active_params(spec) - norms - table * spec.untie_embeddings_and_output_weights


@pytest.mark.parametrize("spec", [_spec("dsv3"), _spec("noq"), MODEL_PRESETS["deepseek-v3"]], ids=["dsv3", "noq", "preset"])
def test_flops_are_perf_flops_and_twice_the_active_matmul_parameters(spec):
    """Model FLOPs: perf/flops.py on the spec; without MTP, per token and pass 2 x the active
    matmul parameters plus Q·Kᵀ and probabilities·V."""
    spec = dataclasses.replace(spec, mtp_num_layers=0)
    batch = 8
    _, model_flops = step_flops(spec, 1, batch, "none")
    padded = spec.with_vocab(1)
    assert model_flops == num_floating_point_operations(padded, batch, moe_config=padded if spec.is_moe else None)
    per_pass = 2 * batch * spec.seq_length * _matmul_params(spec) + spec.num_layers * core_attention_flops(spec, batch)
    assert model_flops / 3 == pytest.approx(per_pass, rel=1e-12)


def test_planner_flops_equal_the_built_models_count():
    """The same count from the tiny model's own TransformerConfig (MTP included)."""
    config = _config("dsv3")
    assert step_flops(_spec("dsv3"), 1, 8, "full")[0] == num_floating_point_operations(config, 8, True, config)


def test_deepseek_v3_preset_is_671b_total_and_37b_active():
    spec = MODEL_PRESETS["deepseek-v3"]
    total = sum(stage_params(dataclasses.replace(spec, mtp_num_layers=0), 1, 1, 1, True, True))
    assert round(total / 1e9) == 671
    assert 37.0 < active_params(spec) / 1e9 < 38.0
    # with its MTP layer 682.6B (DeepSeek's 685B also counts the MTP module's own embedding and head copies)
    assert sum(stage_params(spec, 1, 1, 1, True, True)) / 1e9 == pytest.approx(682.64, abs=0.01)
    assert stage_layers(spec, 16) == [3] + [4] * 14 + [2]  # the launch script's --decoder-first/last-...
    with pytest.raises(ConfigError, match="PP 64 cannot split --num-layers 61"):
        stage_layers(spec, 64)


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (2, True), (4, True)])
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_mla_activation_formula_is_korthikantis_for_a_multi_head_shape(t, sp, recompute):
    if recompute == "selective" and t > 1 and not sp:
        return  # the paper's selective count assumes sequence parallelism
    s, b, h, a = 2048, 2, 1024, 16
    mha = mla_layer_bytes(s, b, h, a, t, sp, recompute, None, 0, h // a, 0, h // a)
    assert mha == korthikanti_layer_bytes(s, b, h, a, t, sp, recompute)
    bigger = mla_layer_bytes(s, b, h, a, t, sp, recompute, 512, 256, 128, 64, 128)
    assert bigger > mha or recompute == "full"


BIG = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=32000,
                swiglu=True, add_bias_linear=False, learned_positions=False, normalization="RMSNorm",
                multi_latent_attention=True, q_lora_rank=512, kv_lora_rank=256, qk_head_dim=64, qk_pos_emb_head_dim=32,
                v_head_dim=64, qk_layernorm=True, mtp_num_layers=1)
CLUSTER = ClusterSpec(gpus=16, gpus_per_node=8, gpu_memory_gb=80, peak_tflops=100, intra_node_gbps=100,
                      inter_node_gbps=10)


def test_memory_counts_mla_layers_and_the_mtp_layer_with_its_logits():
    est = estimate(BIG, CLUSTER, 64, Layout(dp=16, micro_batch=2))
    per_layer = mla_layer_bytes(2048, 2, 1024, 16, 1, False, None, 512, 256, 64, 32, 64)
    logits = 4 * 2 * 2048 * 32000
    assert est.activation_gb * GB == pytest.approx((8 + 1) * per_layer + 2 * logits)
    assert est.model_state_gb * GB == pytest.approx(18 * sum(stage_params(BIG, 1, 1, 1, True, True)))


def test_traffic_counts_mla_transfers_and_the_mtp_layer():
    lay = Layout(tp=2, cp=2, dp=4)
    tokens = 2048 // 2 * 2  # s/cp tokens, bf16
    hidden, latents = ring_bytes("all_reduce", tokens * 1024, 2), ring_bytes("all_reduce", tokens * (512 + 256 + 32), 2)
    # 8 layers and MTP, 3 micro-batches; the embedding's and the output layer's all-reduce
    assert volumes.tp_bytes(BIG, lay, 3) == (8 + 1) * 3 * (3 * hidden + latents) + 2 * 3 * hidden
    kv = (16 // 2) * (64 + 32 + 64) * tokens  # every local head's key and value
    assert volumes.cp_bytes(BIG, lay, 3) == (8 + 1) * 3 * (2 * 2 - 2 + 2 * 2) * kv  # the gradient's c hops in fp32
    # PP2: the last stage holds 4 layers and the MTP layer
    assert volumes.stage_layer_counts(BIG, 2) == (5, 0)
    assert volumes.stage_layer_counts(MODEL_PRESETS["deepseek-v3"], 16) == (4, 4)  # stage 1's 4 MoE layers; the last: 2 + MTP = 3


def test_check_layout_and_tool_take_uneven_stages():
    spec = MODEL_PRESETS["deepseek-v3"]
    cluster = ClusterSpec(gpus=1024, gpus_per_node=8, gpu_memory_gb=80, peak_tflops=989)
    check_layout(spec, cluster, 15360, Layout(tp=2, pp=16, dp=32, ep=32))
    with pytest.raises(ConfigError, match="PP 16 x VPP 2 must divide --num-layers 61"):
        check_layout(spec, cluster, 15360, Layout(tp=2, pp=16, dp=32, ep=32, vpp=2))


def test_tool_plans_the_preset(capsys):
    assert plan_tool.main(["--preset", "deepseek-v3", "--cluster", "h100", "--gpus", "1024", "--global-batch-size",
                           "15360", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "16",
                           "--expert-model-parallel-size", "32", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "682.64 B parameters (37.55 B active)" in out and "best: TP 2, PP 16" in out and "EP 32" in out
    assert plan_tool.main(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                           "64", "--vocab-size", "1000", "--multi-latent-attention", "--position-embedding-type",
                           "rope", "--q-lora-rank", "32",
                           "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim",
                           "16", "--mtp-num-layers", "1", "--gpus", "2", "--global-batch-size", "4", "--top", "1"]) == 0
    assert "best:" in capsys.readouterr().out

