"""The planner's ZB-H1 pipeline schedule: its bubble is its order's simulated bubble, its activations
are its order's peak in flight, it is searched beside 1F1B where it differs (interleaved zero bubble,
with virtual stages, when asked for), and tools/plan.py takes --pipeline-schedule."""

import os
import sys

import pytest
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.parallel.pipeline.order import rank_order
from megatron_lite.parallel.pipeline.trace import bubble_fraction, peak_in_flight, simulate
from megatron_lite.perf.activation_memory import korthikanti_layer_bytes
from megatron_lite.perf.model_state import model_state_bytes_per_param
from megatron_lite.perf.plan import ClusterSpec, Layout, ModelSpec, check_layout, estimate, plan, stage_params
from megatron_lite.perf.plan.estimate import in_flight_microbatches, memory_bytes, pipeline_bubble

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tools import plan as plan_tool  # noqa: E402

SPEC = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024, vocab_size=32000)
CLUSTER = ClusterSpec(gpus=16, gpus_per_node=8, gpu_memory_gb=80, peak_tflops=312, intra_node_gbps=300,
                      inter_node_gbps=25)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 12, 16])
def test_bubbles_are_the_simulated_orders(p, m):
    """F, B and W of equal cost (1F1B's backward = B + W); ZB-H1 with m >= p is a third of 1F1B's."""
    orders = {s: {r: rank_order(p, r, m, 1, s) for r in range(p)} for s in ("1f1b", "zb-h1")}
    one_f_one_b = bubble_fraction(simulate(orders["1f1b"], p, 1, 1.0, 2.0, 0.0))
    zero_bubble = bubble_fraction(simulate(orders["zb-h1"], p, 1, 1.0, 1.0, 1.0))
    assert pipeline_bubble(p, m) == pytest.approx(one_f_one_b, rel=1e-12)
    assert pipeline_bubble(p, m, 1, "zb-h1") == pytest.approx(zero_bubble, rel=1e-12)
    if m >= p:
        assert pipeline_bubble(p, m, 1, "zb-h1") == pytest.approx(one_f_one_b / 3, rel=1e-12)
    assert pipeline_bubble(p, m, 1, "zb-h1") < one_f_one_b


@pytest.mark.parametrize("p, m", [(2, 1), (4, 2), (4, 8), (8, 16)])
def test_zb_h1_in_flight_is_its_orders_peak_on_every_stage(p, m):
    for i in range(p):
        assert in_flight_microbatches(p, i, m, 1, "zb-h1") == peak_in_flight(rank_order(p, i, m, 1, "zb-h1"))


def test_zb_h1_estimate_same_memory_as_1f1b_rank_0_and_a_third_of_the_bubble():
    one, zb = (Layout(tp=2, pp=4, dp=2, schedule=s) for s in ("1f1b", "zb-h1"))
    a, b = estimate(SPEC, CLUSTER, 64, one), estimate(SPEC, CLUSTER, 64, zb)
    assert b.bubble == pytest.approx(a.bubble / 3) and b.step_s < a.step_s and b.compute_s == a.compute_s
    m = a.num_microbatches
    per_layer = korthikanti_layer_bytes(1024, 1, 1024, 16, 2, True, None)
    bpp = model_state_bytes_per_param(torch.bfloat16, "no_shard", 2)
    stages = [(sum(stage_params(SPEC, 2, 4, 1, i == 0, i == 3, i)) * bpp,
               2 * per_layer * min(4, m) + (4 * 1024 * SPEC.padded_vocab(2) / 2 if i == 3 else 0)) for i in range(4)]
    assert memory_bytes(SPEC, zb, m) == pytest.approx(max(stages, key=sum))  # every stage holds p micro-batches
    assert b.activation_gb >= a.activation_gb  # the last stages hold more than under 1F1B


def test_interleaved_zero_bubble_estimate():
    """With virtual stages: a third of interleaved 1F1B's bubble, every stage holding what interleaved
    1F1B's first stage holds (its peak), and an unknown schedule refused."""
    one, zb = (Layout(pp=2, dp=8, vpp=2, schedule=s) for s in ("1f1b", "zb-h1"))
    a, b = estimate(SPEC, CLUSTER, 64, one), estimate(SPEC, CLUSTER, 64, zb)
    assert b.bubble == pytest.approx(a.bubble / 3) and b.step_s < a.step_s
    m = a.num_microbatches
    assert [in_flight_microbatches(2, i, m, 2, "zb-h1") for i in range(2)] == [in_flight_microbatches(2, 0, m, 2)] * 2
    assert b.activation_gb >= a.activation_gb
    with pytest.raises(ConfigError, match="--pipeline-schedule gpipe: one of 1f1b, zb-h1"):
        check_layout(SPEC, CLUSTER, 64, Layout(pp=2, dp=8, vpp=2, schedule="gpipe"))


def test_the_search_offers_zb_h1_where_it_differs_from_1f1b():
    layouts = [e.layout for e in plan(SPEC, CLUSTER, 64, {"tp": 2})]
    zb = [lay for lay in layouts if lay.schedule == "zb-h1"]
    assert zb and all(lay.pp > 1 and lay.vpp == 1 for lay in zb)
    fixed = [e.layout for e in plan(SPEC, CLUSTER, 64, {"tp": 2, "schedule": "zb-h1"})]  # asked for: any VPP
    assert {lay.schedule for lay in fixed} == {"zb-h1"} and {lay.vpp for lay in fixed} > {1}
    one_f_one_b = {(lay.pp, lay.vpp) for lay in layouts if lay.schedule == "1f1b"}
    assert (1, 1) in one_f_one_b and any(v > 1 for _, v in one_f_one_b)
    assert {e.layout.schedule for e in plan(SPEC, CLUSTER, 64, {"tp": 2, "schedule": "1f1b"})} == {"1f1b"}


def test_tool_takes_the_schedule_with_and_without_virtual_stages(capsys):
    argv = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
            "--vocab-size", "32000", "--gpus", "16", "--global-batch-size", "64", "--top", "3",
            "--pipeline-model-parallel-size", "4"]
    assert plan_tool.main(argv + ["--pipeline-schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert " sched " in out and ", ZB-H1, ZeRO" in out.split("best:")[1] and " 1f1b " not in out
    assert plan_tool.main(argv + ["--pipeline-schedule", "1f1b"]) == 0
    assert " sched " not in capsys.readouterr().out  # the column only where some row runs ZB-H1
    assert plan_tool.main(argv + ["--pipeline-schedule", "zb-h1", "--virtual-pipeline-model-parallel-size", "2"]) == 0
    assert "VPP 2, DP 4, CP 1, EP 1, zero bubble interleaved, ZeRO" in capsys.readouterr().out.split("best:")[1]
