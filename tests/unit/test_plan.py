"""The layout planner: parameter counts equal built models', estimates compose the perf formulas,
the search keeps only runnable layouts in order, and tools/plan.py prints, draws and refuses."""

import os
import re
import sys
from fractions import Fraction

import pytest
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.pipeline.order import rank_order
from megatron_lite.parallel.pipeline.trace import peak_in_flight
from megatron_lite.parallel.state import ParallelState
from megatron_lite.perf.activation_memory import korthikanti_layer_bytes
from megatron_lite.perf.model_state import model_state_bytes_per_param
from megatron_lite.perf.plan import (
    MODEL_PRESETS,
    RESERVED_BYTES,
    ClusterSpec,
    Layout,
    ModelSpec,
    check_layout,
    estimate,
    plan,
    stage_params,
    volumes,
)
from megatron_lite.perf.plan.estimate import memory_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tools import plan as plan_tool  # noqa: E402

GB = 2**30
SHAPES = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
VARIANTS = [  # (ModelSpec fields, TransformerConfig fields)
    ({}, {}),
    (dict(num_query_groups=2, swiglu=True, add_bias_linear=False, learned_positions=False, ffn_hidden_size=48,
          untie_embeddings_and_output_weights=True),
     dict(num_query_groups=2, swiglu=True, add_bias_linear=False, position_embedding_type="rope", ffn_hidden_size=48,
          untie_embeddings_and_output_weights=True)),
    (dict(num_experts=4, moe_ffn_hidden_size=16, add_bias_linear=False),
     dict(num_experts=4, moe_ffn_hidden_size=16, add_bias_linear=False)),
    (dict(qk_layernorm=True), dict(qk_layernorm=True)),  # per-head q/k LayerNorms: weight + bias each
    # with biases: the router's, every expert's fc2 bias, the shared experts' (one fc2 bias, not the dense MLP's)
    (dict(num_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=2), dict(num_experts=4, moe_ffn_hidden_size=16,
                                                                          moe_layer_freq=2)),
    (dict(num_experts=4, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=24, swiglu=True),
     dict(num_experts=4, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=24, swiglu=True)),
]


@pytest.mark.parametrize("spec_fields,config_fields", VARIANTS,
                         ids=["gpt", "llama", "moe", "qk_norm", "moe_bias", "moe_bias_shared"])
def test_stage_parameters_equal_a_built_model(spec_fields, config_fields):
    spec = ModelSpec(**SHAPES, **spec_fields)
    config = TransformerConfig(max_position_embeddings=16, **SHAPES, **config_fields)
    for pre, post, lo, hi, pp in [(True, True, 0, 4, 1), (True, False, 0, 2, 2), (False, True, 2, 4, 2)]:
        model = GPTModel(config, ParallelState(), pre_process=pre, post_process=post, layer_start=lo, layer_end=hi)
        dense, expert = stage_params(spec, 1, pp, 1, pre, post)
        assert dense + expert == model.num_parameters(), (pre, post)


def test_presets_have_their_published_sizes():
    billions = {name: sum(stage_params(spec, 1, 1, 1, True, True)) / 1e9 for name, spec in MODEL_PRESETS.items()}
    assert round(billions["gpt3-175b"]) == 175 and round(billions["gpt-1t"]) == 1008
    assert round(billions["llama3-8b"], 1) == 8.0 and round(billions["llama3-70b"], 1) == 70.6
    assert round(billions["mixtral-8x7b"], 1) == 46.7


def test_sharding_strategies_bytes_per_param():
    assert model_state_bytes_per_param(torch.bfloat16, "no_shard", 8) == 18 == model_state_bytes_per_param(torch.bfloat16)
    assert model_state_bytes_per_param(torch.bfloat16, "optim", 8) == 6 + Fraction(12, 8)
    assert model_state_bytes_per_param(torch.bfloat16, "optim_grads", 8) == 2 + Fraction(16, 8)
    assert model_state_bytes_per_param(torch.bfloat16, "optim_grads_params", 8) == Fraction(18, 8)
    with pytest.raises(ValueError, match="sharding strategy"):
        model_state_bytes_per_param(torch.bfloat16, "zero4", 8)


SPEC = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=32000)
CLUSTER = ClusterSpec(gpus=16, gpus_per_node=8, gpu_memory_gb=80, peak_tflops=100, intra_node_gbps=100,
                      inter_node_gbps=10)


def test_memory_composes_state_and_korthikanti():
    """One stage, no TP: 18 bytes per parameter, L layers of one micro-batch's activations, fp32 logits."""
    lay = Layout(dp=16, micro_batch=2)
    est = estimate(SPEC, CLUSTER, 64, lay)
    params = sum(stage_params(SPEC, 1, 1, 1, True, True))
    assert est.model_state_gb * GB == pytest.approx(18 * params)
    acts = 8 * korthikanti_layer_bytes(2048, 2, 1024, 16) + 4 * 2 * 2048 * 32000
    assert est.activation_gb * GB == pytest.approx(acts)
    assert est.memory_gb * GB == pytest.approx(18 * params + acts + RESERVED_BYTES)
    full = estimate(SPEC, CLUSTER, 64, Layout(dp=16, micro_batch=2, recompute="full"))
    assert full.activation_gb * GB == pytest.approx(8 * 2 * 2048 * 2 * 1024 + korthikanti_layer_bytes(2048, 2, 1024, 16)
                                                    + 4 * 2 * 2048 * 32000)
    sharded = [estimate(SPEC, CLUSTER, 64, Layout(dp=16, zero=z)).model_state_gb
               for z in ("no_shard", "optim", "optim_grads", "optim_grads_params")]
    assert sharded == sorted(sharded, reverse=True) and sharded[-1] * 16 == pytest.approx(sharded[0])


def test_pipeline_first_stage_holds_p_microbatches_and_bubble():
    lay = Layout(pp=4, dp=4, vpp=2, recompute="selective")
    est = estimate(SPEC, CLUSTER, 32, lay)
    assert est.num_microbatches == 8 and est.bubble == pytest.approx(3 / (2 * 8))
    per_layer = korthikanti_layer_bytes(2048, 1, 1024, 16, recompute="selective")
    first_state = sum(stage_params(SPEC, 1, 4, 1, True, False)) * 18
    assert est.activation_gb * GB == pytest.approx(2 * per_layer * 4 * (1 + 3 / 8))
    assert est.model_state_gb * GB == pytest.approx(first_state)
    compute_part = est.compute_s + est.comm_s["pp"]
    assert est.step_s == pytest.approx(compute_part * (1 + est.bubble) + est.comm_s["dp"])


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 1, 8), (4, 2, 4)])
def test_stage_activations_hold_the_micro_batches_the_schedule_keeps_in_flight(p, v, m):
    """Every stage's activations are its layers x the peak of forwards done minus backwards done in
    the schedule's own op order (over v chunks): interleaved, the last stage holds p - (p-1)/v
    micro-batches, not one; the fullest stage (here the last: its output layer and logits) is reported."""
    spec = ModelSpec(num_layers=16, hidden_size=256, num_attention_heads=4, seq_length=512, vocab_size=64000,
                     untie_embeddings_and_output_weights=True)  # 16 layers: every p x v here splits them
    lay = Layout(pp=p, vpp=v, recompute="selective")
    per_layer = korthikanti_layer_bytes(512, 1, 256, 4, recompute="selective")
    logits = 4 * 512 * spec.padded_vocab(1)
    stages = []
    for i in range(p):
        held = peak_in_flight(rank_order(p, i, m, v)) / v
        state = sum(stage_params(spec, 1, p, 1, i == 0, i == p - 1, i)) * model_state_bytes_per_param(torch.bfloat16,
                                                                                                        "no_shard", 1)
        stages.append((state, 16 // p * per_layer * held + (logits if i == p - 1 else 0)))
    assert memory_bytes(spec, lay, m) == pytest.approx(max(stages, key=sum))


def test_volumes_use_the_ring_formulas():
    lay = Layout(tp=2, cp=2, dp=4, micro_batch=1)
    n = 1024 * 1024 * 2  # b (s/cp) h, bf16
    # 4 all-reduces per layer, L layers, m; the embedding's and the output layer's one each per micro-batch
    assert volumes.tp_bytes(SPEC, lay, 3) == (8 * 4 + 2) * 3 * (2 * 1 / 2 * n)
    assert volumes.tp_bytes(SPEC, Layout(tp=2, cp=2, dp=2, pp=2), 3) == (4 * 4 + 1) * 3 * (2 * 1 / 2 * n)  # one end a stage
    kv = 2 * (16 // 2) * 1024 * 64 * 2
    # the ring the counter measures: 2c-2 hops of the bf16 K/V, c hops of its fp32 gradient (twice the bytes)
    assert volumes.cp_bytes(SPEC, lay, 3) == 8 * 3 * (2 * 2 - 2 + 2 * 2) * kv
    assert volumes.dp_bytes(1000, "no_shard", 4, 3) == 2 * 3 / 4 * 4000
    assert volumes.dp_bytes(1000, "optim", 4, 3) == 3 / 4 * 4000 + 3 / 4 * 2000
    moe = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=64, num_experts=4)
    assert volumes.ep_bytes(moe, Layout(ep=4, dp=4), 1) == 2 * 2 * (2 * 32 * 64 * 2 * 3 / 4) * 2


def test_check_layout_refuses_with_one_line():
    for lay, match in [(Layout(tp=16, dp=1), "TP 16 must divide"), (Layout(pp=3, dp=16), "must equal --gpus"),
                       (Layout(dp=16, vpp=2), "VPP 2 needs PP > 1"), (Layout(dp=16, ep=2), "EP 2 needs"),
                       (Layout(dp=16, micro_batch=3), "--global-batch-size 64 must be divisible")]:
        with pytest.raises(ConfigError, match=match):
            check_layout(SPEC, CLUSTER, 64, lay)


def test_plan_lists_runnable_layouts_fitting_and_fastest_first():
    estimates = plan(SPEC, CLUSTER, 64)
    assert estimates and all(check_layout(SPEC, CLUSTER, 64, e.layout) is None for e in estimates)
    fits = [e.fits for e in estimates]
    assert fits == sorted(fits, reverse=True)
    fitting = [e.step_s for e in estimates if e.fits]
    assert fitting == sorted(fitting)
    assert {e.layout.tp for e in plan(SPEC, CLUSTER, 64, {"tp": 2})} == {2}


def test_tool_prints_table_and_best(capsys, tmp_path):
    argv = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
            "--vocab-size", "32000", "--gpus", "16", "--global-batch-size", "64", "--top", "3",
            "--png", str(tmp_path / "plan.png")]
    assert plan_tool.main(argv) == 0
    out = capsys.readouterr().out
    assert "TP  PP  VPP  DP  CP  EP" in out and "best: TP" in out and "MFU" in out
    assert os.path.getsize(tmp_path / "plan.png") > 0
    assert sorted(os.listdir(tmp_path)) == ["plan.png"]  # written whole, then renamed
    assert plan_tool.main(["--preset", "mixtral-8x7b", "--cluster", "h100", "--gpus", "16", "--global-batch-size", "32",
                           "--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "2", "--top", "1"]) == 0
    assert "EP 8" in capsys.readouterr().out


def test_tool_prints_enough_digits_for_a_tiny_model(capsys):
    """A model of a few thousand parameters: its count, memory and throughput are not printed as 0."""
    assert plan_tool.main(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
                           "16", "--vocab-size", "100", "--gpus", "8", "--global-batch-size", "8", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "0.00 B" not in out and re.search(r"model: \d+\.\d K parameters", out), out
    best = out.split("best:")[1]
    assert " 0.0 TFLOP/s" not in best and "memory per GPU 0.0 of" not in best, best
    table = out.split("\n")[2:4]  # header and first row
    assert not re.search(r"\s0\.0\s", table[1]), table


def test_tool_png_without_matplotlib_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "matplotlib is not installed" in plan_tool.draw([], str(tmp_path / "x.png"), 80)


def test_tool_refuses_bad_input_with_exit_2(capsys):
    assert plan_tool.main(["--gpus", "8", "--global-batch-size", "8"]) == 2
    assert "give --preset or the model flags" in capsys.readouterr().err
    assert plan_tool.main(["--preset", "llama3-8b", "--gpus", "12", "--global-batch-size", "8"]) == 2
    assert "--gpus 12 must be a multiple of --gpus-per-node 8" in capsys.readouterr().err


def test_fixed_layout_values_outside_the_search_choices_are_planned():
    """--micro-batch-size 3, --virtual-pipeline-model-parallel-size 3 and a PP that neither divides the
    layers nor is a power of two are valid runs: the planner estimates them (it found no layout)."""
    spec = ModelSpec(num_layers=24, hidden_size=256, num_attention_heads=8, seq_length=64, vocab_size=1000)
    for fixed, gpus, batch in (({"micro_batch": 3}, 24, 48), ({"pp": 2, "vpp": 3}, 24, 48), ({"pp": 5}, 40, 40)):
        estimates = plan(spec, ClusterSpec(gpus=gpus), batch, fixed)
        assert estimates, fixed
        assert all(getattr(e.layout, k) == v for e in estimates for k, v in fixed.items())


def test_odd_sequence_length_plans_without_context_parallelism():
    """CP's 2 x cp chunks are only needed with CP > 1; sequence parallelism (TP > 1) needs seq % TP."""
    spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=15, vocab_size=100)
    layouts = {(e.layout.tp, e.layout.cp) for e in plan(spec, ClusterSpec(gpus=8), 8)}
    assert (1, 1) in layouts and all(cp == 1 for _, cp in layouts)
    with pytest.raises(ConfigError, match=r"--seq-length 15 must be divisible by TP 2 \(sequence parallelism\)"):
        check_layout(spec, ClusterSpec(gpus=8), 8, Layout(tp=2, dp=4))


def test_sequence_parallelism_under_cp_cuts_a_rank_tokens():
    """SP cuts a CP rank's seq / cp tokens over TP: seq 12 fits CP2 x TP2 (it was refused as not
    divisible by 2 x CP 2 x TP 2); seq 20 at CP2 x TP4 leaves 10 tokens a rank, not divisible by 4."""
    spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=12, vocab_size=100)
    check_layout(spec, ClusterSpec(gpus=8), 8, Layout(tp=2, cp=2, dp=2))
    spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=20, vocab_size=100)
    with pytest.raises(ConfigError, match=r"--seq-length 20 / CP 2 must be divisible by TP 4 \(sequence parallelism\)"):
        check_layout(spec, ClusterSpec(gpus=8), 8, Layout(tp=4, cp=2))


@pytest.mark.parametrize("flags, words", [
    (["--tensor-model-parallel-size", "3"], ["--tensor-model-parallel-size 3", "must equal --gpus 16"]),
    (["--micro-batch-size", "5"], ["--micro-batch-size 5", "--global-batch-size 48 must be divisible"]),
    (["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size 2", "--num-experts"]),
    (["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "4"],
     ["--virtual-pipeline-model-parallel-size 4", "PP 4 x VPP 4 must divide --num-layers 24"]),
    (["--tensor-model-parallel-size", "8", "--num-attention-heads", "12"], ["TP 8 must divide --num-attention-heads 12"]),
    # the shared experts are split over TP, as in training (which refuses this size); the layouts were planned
    (["--tensor-model-parallel-size", "2", "--num-experts", "8", "--moe-shared-expert-intermediate-size", "3"],
     ["TP 2 must divide --moe-shared-expert-intermediate-size 3"]),
])
def test_tool_refuses_a_fixed_layout_that_cannot_run_saying_why(capsys, flags, words):
    argv = ["--num-layers", "24", "--hidden-size", "768", "--num-attention-heads", "16", "--seq-length", "512",
            "--vocab-size", "1000", "--gpus", "16", "--global-batch-size", "48"]
    assert plan_tool.main(argv + flags) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "no layout with" in lines[0], captured
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("flags, groups", [([], 8), (["--group-query-attention"], 1),
                                           (["--group-query-attention", "--num-query-groups", "2"], 2)])
def test_group_query_attention_takes_trainings_meaning(flags, groups):
    """A pasted Megatron model line with --group-query-attention was 'unrecognized'; alone it is one
    key/value group (Megatron's --num-query-groups default), as pretrain_gpt.py builds it."""
    argv = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "64",
            "--vocab-size", "1000", "--gpus", "8", "--global-batch-size", "16"]
    spec = plan_tool.model_from_args(plan_tool.build_parser().parse_args(argv + flags))
    assert (spec.num_query_groups or spec.num_attention_heads) == groups


@pytest.mark.parametrize("flags, words", [
    (["--num-query-groups", "0"], ["--num-query-groups", "at least 1"]),
    (["--global-batch-size", "0"], ["--global-batch-size", "at least 1"]),
    (["--micro-batch-size", "0"], ["--micro-batch-size", "at least 1"]),
    (["--tensor-model-parallel-size", "0"], ["--tensor-model-parallel-size", "at least 1"]),
    (["--virtual-pipeline-model-parallel-size", "0"], ["--virtual-pipeline-model-parallel-size"]),
    (["--make-vocab-size-divisible-by", "0"], ["--make-vocab-size-divisible-by"]),
    (["--peak-tflops", "0"], ["--peak-tflops", "positive"]),
    (["--intra-node-gbps", "0"], ["--intra-node-gbps", "positive"]),
    (["--num-experts", "4", "--moe-router-topk", "8"], ["--moe-router-topk 8", "--num-experts 4"]),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0]"], ["--moe-layer-freq"]),
    (["--normalization", "Foo"], ["--normalization"]),
    # a flag the model would ignore, refused as training refuses it (it was planned without it)
    (["--moe-router-topk", "4"], ["--moe-router-topk 4", "no effect without --num-experts"]),
    (["--moe-ffn-hidden-size", "64"], ["--moe-ffn-hidden-size 64", "add --num-experts"]),
    (["--q-lora-rank", "8"], ["--q-lora-rank 8", "no effect without --multi-latent-attention"]),
    (["--v-head-dim", "8"], ["--v-head-dim 8", "add --multi-latent-attention"]),
    (["--window-attn-skip-freq", "2"], ["--window-attn-skip-freq needs --window-size"]),
    (["--window-size", "8", "-2"], ["--window-size", "at least -1"]),
    (["--window-size", "8", "2"], ["--window-size 8 2", "RIGHT must be 0"]),  # was counted as 11 keys a query
    (["--window-size", "8", "0", "--window-attn-skip-freq", "[1,0]"], ["--window-attn-skip-freq [1,0]", "4 zeros"]),
    # models training refuses were planned (MLA and MTP with a learned position table, MLA with query groups)
    (["--multi-latent-attention"], ["--multi-latent-attention needs --position-embedding-type rope"]),
    (["--mtp-num-layers", "1"], ["--mtp-num-layers needs --position-embedding-type rope"]),
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--group-query-attention",
      "--num-query-groups", "2"], ["--multi-latent-attention does not take", "--num-query-groups"]),
    (["--num-query-groups", "2"], ["--num-query-groups 2 needs --group-query-attention"]),  # training's rule
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--qk-pos-emb-head-dim", "3"],
     ["--qk-pos-emb-head-dim 3 must be even"]),
])
def test_tool_refuses_bad_values_in_one_line_not_a_traceback(capsys, flags, words):
    """Zero sizes and bandwidths were ZeroDivisionError tracebacks (exit 1); the docstring promises one line, exit 2."""
    argv = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "64",
            "--vocab-size", "1000", "--gpus", "8", "--global-batch-size", "16", "--top", "1"]
    code = None
    try:
        code = plan_tool.main(argv + flags)
    except SystemExit as err:
        code = err.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    for w in words:
        assert w in lines[0], lines[0]


def test_tool_png_goes_to_a_new_folder(tmp_path, capsys):
    """--png in a folder that does not exist yet: created (it was a FileNotFoundError traceback after the table)."""
    out = tmp_path / "figures" / "new" / "plan.png"
    assert plan_tool.main(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
                           "16", "--vocab-size", "100", "--gpus", "8", "--global-batch-size", "8", "--top", "2",
                           "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(out.parent) == ["plan.png"]


def test_sliding_window_layers_count_their_window_also_recomputed(capsys):
    """Layers 1 and 3 of 4 windowed (--window-size 15 0 --window-attn-skip-freq 2, s = 64): their scores
    and values count 16 keys a query, not 64; selective recomputation repeats each layer's own."""
    from megatron_lite.perf.plan.estimate import step_flops
    shape = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=64, vocab_size=1000)
    full, windowed = ModelSpec(**shape), ModelSpec(**shape, window_size=(15, 0), window_attn_skip_freq="2")
    attention = 2 * 2 * 16 * 64 * 256  # one layer's Q.K^T and probabilities.V per key a query sees (B = 16)
    saved = 2 * attention * (64 - 16)  # two windowed layers
    (_, model_full), (hw, model) = step_flops(full, 1, 16, "none"), step_flops(windowed, 1, 16, "none")
    assert model_full - model == 3 * saved and hw == model
    assert step_flops(windowed, 1, 16, "selective")[0] - hw == attention * (16 + 64 + 16 + 64)
    assert plan_tool.main(["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length",
                           "64", "--vocab-size", "1000", "--gpus", "8", "--global-batch-size", "16", "--top", "1",
                           "--window-size", "15", "0", "--window-attn-skip-freq", "2"]) == 0
    assert "best:" in capsys.readouterr().out


def test_tool_says_why_no_layout_runs_when_nothing_is_pinned(capsys):
    """A prime GPU count no layout takes (llama3-8b on 7 GPUs, batch 64): it printed 'check the divisibility
    of the sizes' and exited 1; now one line with a refused layout's reason, exit 2."""
    assert plan_tool.main(["--preset", "llama3-8b", "--gpus", "7", "--global-batch-size", "64"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured
    assert "no layout can run this model on this cluster: --global-batch-size 64 must be divisible by DP 7" in lines[0]
    assert plan_tool.main(["--preset", "llama3-8b", "--gpus", "7", "--global-batch-size", "63", "--top", "1"]) == 0


def test_bf16_moments_shrink_the_sharded_optimizer_state(capsys):
    """--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: 4 bytes of moments per
    parameter, not 8, over the DP shard (ZeRO-1 at DP 16, bf16 params: 6 + 8/16 bytes per parameter, not 6 + 12/16);
    refused without a sharded strategy and without --use-precision-aware-optimizer, as in training."""
    params = sum(stage_params(SPEC, 1, 1, 1, True, True))
    fp32, bf16 = (estimate(SPEC, CLUSTER, 64, Layout(dp=16, zero="optim", moment_bytes=m)).model_state_gb * GB
                  for m in (8, 4))
    assert fp32 == pytest.approx((6 + Fraction(12, 16)) * params) and bf16 == pytest.approx((6 + Fraction(8, 16)) * params)
    with pytest.raises(ConfigError, match="needs the distributed optimizer"):
        check_layout(SPEC, CLUSTER, 64, Layout(dp=16, moment_bytes=4))
    argv = ["--preset", "llama3-8b", "--gpus", "8", "--global-batch-size", "8", "--exp-avg-dtype", "bf16"]
    assert plan_tool.main(argv) == 2
    assert "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer" in capsys.readouterr().err
    assert plan_tool.main(argv + ["--use-precision-aware-optimizer", "--top", "1"]) == 0
    assert "ZeRO no_shard" not in capsys.readouterr().out
