"""FP8 experts on a folded expert grid equal the one-process FP8 layer (gloo, 4 ranks, two steps).

Folded grids (``--expert-tensor-parallel-size`` other than TP, docs/mixture-of-experts.md):
TP 1 attention with experts split over ETP 2 x EP 2, and TP 2 + SP attention with whole experts
over ETP 1 x EP 4. In both the expert-data-parallel group has one rank, so every expert sees the
tokens of all four ranks, as it does in the one-process layer fed all four ranks' data
(concatenated along the batch). The experts' amaxes are MAX-reduced over the folded ETP group, so
each expert-tensor shard is cast with the scale of the whole tensor; delayed scaling's once-per-step
update reduces over the expert-DP group. On every rank, for two steps (the second with the learned
delayed scales): the output and input gradient of its tokens, and every expert parameter's gradient
(this rank's experts, its ETP shard) equal the reference's within fp32 summation order (1e-5 of
the reference's largest value), and so do the experts' FP8 scales. The control without the ETP
amax reduction misses it (each half of a split expert gets its own scale).
"""

import pytest
import torch

from megatron_lite.moe.layer import MoELayer
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import shard
from megatron_lite.precision.fp8 import fp8_gemms, update_fp8_scales
from tests.harness import cached_state, run_ranks
from tests.moe_helpers import moe_config

S, B, H = 8, 2, 32


def _config(recipe, **parallel):
    return moe_config(hidden_size=H, moe_ffn_hidden_size=32, num_experts=4, swiglu=True, init_method_std=0.05,
                      fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=2, fp8_amax_compute_algo="max",
                      moe_grouped_gemm=True, **parallel)


def _data(step, ranks):
    gens = [torch.Generator().manual_seed(100 * step + d) for d in range(ranks)]
    return [(torch.randn(S, B, H, generator=g) * (1 + step), torch.randn(S, B, H, generator=g)) for g in gens]


def _run(layer, x, dy):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(dy)
    return out.detach(), x.grad


def check_folded_fp8(ep, tp, etp, recipe, reduce_amax):
    state = cached_state(ep=ep, tp=tp, etp=etp)
    assert state.folded
    ref = MoELayer(_config(recipe), ParallelState(world_size=1, rank=0), 1)
    layer = MoELayer(_config(recipe, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp), state, 1)
    if not reduce_amax:
        for g in fp8_gemms(layer):
            g.amax_group = None
    dp = state.dp_size
    first, local = layer.experts.first_expert, layer.experts.num_local_experts
    worst = 0.0
    for step in range(2):
        data = _data(step, dp)
        want_out, want_dx = _run(ref, torch.cat([x for x, _ in data], 1), torch.cat([dy for _, dy in data], 1))
        mine = slice(state.dp_rank * B, (state.dp_rank + 1) * B)
        x, dy = (t.chunk(tp, dim=0)[state.tp_rank] for t in data[state.dp_rank])
        got = list(_run(layer, x, dy))
        want = [t[:, mine].chunk(tp, dim=0)[state.tp_rank] for t in (want_out, want_dx)]
        for name in ("weight1", "weight2"):
            p, full = getattr(layer.experts, name), getattr(ref.experts, name).grad[first:first + local]
            got.append(p.grad)
            want.append(shard(full, p.partition_dim, state.etp_rank, state.etp_size, p.partition_stride))
        for a, b in zip(got, want):
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
        update_fp8_scales(ref)
        update_fp8_scales(layer, data_parallel_group=state.dp_cp_group, expert_data_parallel_group=state.expert_dp_group)
    if reduce_amax:  # this rank's experts hold the reference experts' scales (not at step 0's 1)
        mine_ref = fp8_gemms(ref.experts)[2 * first:2 * (first + local)]
        for a, b in zip(fp8_gemms(layer.experts), mine_ref, strict=True):
            torch.testing.assert_close(a.scale, b.scale, rtol=1e-6, atol=0)
    return worst


@pytest.mark.parametrize("ep,tp,etp", [(2, 1, 2), (4, 2, 1)])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_folded_fp8_experts_equal_one_process(ep, tp, etp, recipe):
    for worst in run_ranks(4, check_folded_fp8, ep, tp, etp, recipe, True):
        assert worst < 1e-5, worst


def test_folded_fp8_experts_without_etp_amax_reduction_differ():
    assert max(run_ranks(4, check_folded_fp8, 2, 1, 2, "tensorwise", False)) > 1e-3
