"""The planner's expert tensor parallelism (--expert-tensor-parallel-size, ETP): each GPU holds E / EP
experts split over ETP, their optimizer state sharded over the rank grid's expert-data-parallel
ranks (folded grid: TP x CP x DP / (ETP x EP)), the tokens a rank received all-gathered over ETP
before the experts and reduce-scattered after; the MoE layer's TP traffic is then the attention's
only. Numbers by hand for known layouts of one model on 16 GPUs."""

import os
import sys

import pytest
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.perf.comm_volume import ring_bytes
from megatron_lite.perf.model_state import model_state_bytes_per_param
from megatron_lite.perf.plan import (
    ClusterSpec,
    Layout,
    ModelSpec,
    check_layout,
    estimate,
    plan,
    stage_params,
    volumes,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tools import plan as plan_tool  # noqa: E402

GB = 2**30
H, F, S, E = 1024, 2048, 2048, 16
MOE = ModelSpec(num_layers=4, hidden_size=H, num_attention_heads=16, seq_length=S, vocab_size=32000, num_experts=E,
                moe_ffn_hidden_size=F, swiglu=True, add_bias_linear=False, learned_positions=False,
                normalization="RMSNorm")
CLUSTER = ClusterSpec(gpus=16, gpus_per_node=8, gpu_memory_gb=80, peak_tflops=100, intra_node_gbps=100,
                      inter_node_gbps=10)
EXPERT = 3 * H * F  # one SwiGLU expert: fc1 (gate and up) and fc2


@pytest.mark.parametrize("lay, experts, expert_dp", [
    (Layout(tp=2, dp=8, ep=4, zero="optim"), E // 4 / 2, 2),  # ETP = TP: EP inside DP, split over TP
    (Layout(tp=2, dp=8, ep=4, etp=1, zero="optim"), E // 4, 2),  # whole experts, copied on the 2 TP ranks
    (Layout(tp=2, dp=8, ep=16, etp=1, zero="optim"), E // 16, 1),  # folded: ETP 1 x EP 16 (EP spans TP)
    (Layout(tp=1, dp=16, ep=4, etp=2, zero="optim"), E // 4 / 2, 2),  # folded: ETP 2 x EP 4 x expert-DP 2
    (Layout(tp=1, dp=4, cp=4, ep=8, etp=2, zero="optim_grads_params"), E // 8 / 2, 1),  # EP over CP too
])
def test_expert_memory_is_e_over_ep_experts_split_over_etp_sharded_over_expert_dp(lay, experts, expert_dp):
    dense, expert = stage_params(MOE, lay.tp, 1, lay.ep, True, True, etp=lay.etp)
    assert expert == experts * 4 * EXPERT  # 4 MoE layers
    assert dense == stage_params(MOE, lay.tp, 1, 1, True, True)[0]  # the dense part does not depend on the experts
    assert lay.expert_dp == expert_dp
    est = estimate(MOE, CLUSTER, 64, lay)
    bpp = [float(model_state_bytes_per_param(torch.bfloat16, lay.zero, d)) for d in (lay.dp * lay.cp, expert_dp)]
    assert est.model_state_gb * GB == pytest.approx(dense * bpp[0] + expert * bpp[1])


def test_expert_tensor_parallel_traffic_and_the_moe_layers_tp_half():
    m = 4  # 64 / (DP 16 x micro-batch 1) micro-batches
    folded = Layout(tp=1, dp=16, ep=4, etp=2)
    slots = 2 * S  # top-2 of a rank's S tokens (TP 1, CP 1)
    gather = (2 - 1) * slots * H * 2  # ring all-gather of ETP x slots 16-bit rows; the reduce-scatter sends the same
    assert volumes.etp_bytes(MOE, folded, m) == 2 * 2 * gather * 4 * m  # forward + backward, AG + RS, 4 layers
    est = estimate(MOE, CLUSTER, 64, folded)
    assert est.comm_s["etp"] == pytest.approx(volumes.etp_bytes(MOE, folded, m) / 100e9)  # ETP 2 inside a node
    assert est.comm_s["tp"] == 0 and estimate(MOE, CLUSTER, 64, Layout(dp=16, ep=4)).comm_s["etp"] == 0
    # TP 2: the MoE layers keep the attention's TP collectives only; ETP 2 (the default) gathers 1/2 of the slots
    tp2, whole = Layout(tp=2, dp=8, ep=4), Layout(tp=2, dp=8, ep=4, etp=1)
    hidden = ring_bytes("all_reduce", S * H * 2, 2)
    ends = 2 * hidden * m  # the embedding's and the output layer's all-reduce
    assert volumes.tp_bytes(MOE, tp2, m) == volumes.tp_bytes(MOE, whole, m) == (hidden + hidden) * 4 * m + ends
    assert volumes.etp_bytes(MOE, tp2, m) == 2 * 2 * ring_bytes("all_gather", 2 * (2 * S // 2) * H * 2, 2) * 4 * m
    assert volumes.etp_bytes(MOE, whole, m) == 0
    shared = ModelSpec(**{**MOE.__dict__, "moe_shared_expert_intermediate_size": F})
    assert volumes.tp_bytes(shared, tp2, m) == (hidden + hidden + 2 * hidden) * 4 * m + ends  # the shared expert's MLP half
    assert estimate(MOE, CLUSTER, 64, whole).comm_s["etp"] == 0 < estimate(MOE, CLUSTER, 64, tp2).comm_s["etp"]


@pytest.mark.parametrize("spec, lay, words", [
    (MOE, Layout(tp=2, dp=8, ep=16, etp=2), "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 16"),
    (MOE, Layout(dp=16, ep=2, etp=3), "ETP 3 must divide --moe-ffn-hidden-size 2048"),
    (MOE, Layout(dp=16, ep=32), "EP 32 must divide --num-experts 16"),
    (ModelSpec(num_layers=4, hidden_size=H, num_attention_heads=16, seq_length=S, vocab_size=32000), Layout(dp=16, etp=1),
     "ETP 1 needs a mixture-of-experts model"),
])
def test_expert_grids_that_cannot_run_are_refused(spec, lay, words):
    with pytest.raises(ConfigError, match=words):
        check_layout(spec, CLUSTER, 64, lay)


def test_search_tries_whole_experts_at_tp_above_one_and_the_tool_takes_the_flag(capsys):
    found = {(e.layout.tp, e.layout.expert_tp) for e in plan(MOE, CLUSTER, 64, {"pp": 1, "ep": 16, "zero": "optim"})}
    assert (2, 1) in found and (2, 2) not in found and (1, 1) in found  # EP 16 with ETP 2 cannot fit in 16 GPUs
    argv = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
            "--vocab-size", "32000", "--num-experts", "16", "--moe-ffn-hidden-size", "2048", "--swiglu",
            "--gpus", "16", "--global-batch-size", "64", "--top", "2", "--tensor-model-parallel-size", "1"]
    assert plan_tool.main(argv + ["--expert-tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "ETP" in out.splitlines()[2] and ", ETP 2," in out, out
    assert plan_tool.main(argv + ["--expert-tensor-parallel-size", "3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--expert-tensor-parallel-size 3" in lines[0] and "ETP 3 must divide" in lines[0], lines
