"""Tensor-parallel FP8 linears equal the single-process FP8 linear, on real gloo groups.

Every rank builds the full weight, input and output gradient; the reference is one unsharded
:class:`Fp8Gemm` (no group) run on this rank. The sharded ColumnParallelLinear / RowParallelLinear
get an :class:`Fp8Gemm` through their ``gemm=`` seam, with amaxes MAX-reduced over the TP group, so each shard is quantised with the scale of the full tensor and
the sharded GEMMs compute the same FP8 products. Outputs and gradients must agree within fp32
summation-order differences (1e-5 of the reference's scale) over three steps in which the input
magnitude changes (so delayed scales move). The control run without the amax reduction must miss
that tolerance: per-shard scales quantise differently (errors of FP8 size, ~1e-2).
"""

import pytest
import torch

from megatron_lite.parallel import comm
from megatron_lite.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_reduce_sequence_parallel_grads,
    shard,
)
from megatron_lite.precision.fp8 import Fp8Gemm, Fp8Recipe, update_fp8_scales
from tests.harness import cached_state, run_ranks

S, B, IN, OUT = 16, 2, 64, 96
STEPS = 3


def _rand(shape, seed, std=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def _chunk(x, dim, group):
    return x.chunk(comm.group_size(group), dim=dim)[comm.group_rank(group)]


class _UnshardedFp8Linear(torch.nn.Module):
    """The single-process reference: the full weight and bias through one Fp8Gemm (no group)."""

    def __init__(self, w, b, recipe):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
        self.gemm = Fp8Gemm(recipe)

    def forward(self, x):
        return self.gemm(x, self.weight, self.bias)


def _layer(kind, w, b, recipe, group, sp, reduce_amax):
    """ColumnParallelLinear / RowParallelLinear with an Fp8Gemm, holding this rank's shard of w, b."""
    gemm = Fp8Gemm(recipe, amax_group=group if reduce_amax else None)
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls(w.shape[1], w.shape[0], group, sequence_parallel=sp, gemm=gemm)
    rank = comm.group_rank(group)
    with torch.no_grad():
        layer.weight.copy_(shard(w, 0 if kind == "column" else 1, rank, 2))
        layer.bias.copy_(shard(b, 0, rank, 2) if kind == "column" else b)
    assert layer.gemm is gemm and "gemm.scale" in layer.state_dict()  # a submodule: checkpointed
    return layer


def _step(layer, x, dy):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    y.backward(dy)
    return [y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad]


def check_tp_fp8_linear(kind, recipe_name, sp, reduce_amax, dims=(IN, OUT)):
    state = cached_state(tp=2)
    g, rank = state.tp_group, state.tp_rank
    recipe = Fp8Recipe(format="hybrid", recipe=recipe_name, amax_history_len=2, amax_compute_algo="max")
    (n_in, n_out), scales = dims, torch.logspace(-3, 1, dims[0])  # input features of many magnitudes
    w, b = _rand((n_out, n_in), 1, 0.05) * scales.flip(0), _rand(n_out, 2, 0.1)
    ref_layer, layer = _UnshardedFp8Linear(w, b, recipe), _layer(kind, w, b, recipe, g, sp, reduce_amax)
    column, worst = kind == "column", 0.0
    for step in range(STEPS):
        x, dy = _rand((S, B, n_in), 3 + step, 1.0 + step) * scales, _rand((S, B, n_out), 13 + step, 1e-3 * (step + 1))
        ref = _step(ref_layer, x, dy)
        if column:
            x_local, dy_local = (_chunk(x, 0, g) if sp else x), shard(dy, 2, rank, 2)
            want = [shard(ref[0], 2, rank, 2), _chunk(ref[1], 0, g) if sp else ref[1],
                    shard(ref[2], 0, rank, 2), shard(ref[3], 0, rank, 2)]
        else:
            x_local, dy_local = _chunk(x, 2, g), (_chunk(dy, 0, g) if sp else dy)
            want = [_chunk(ref[0], 0, g) if sp else ref[0], _chunk(ref[1], 2, g), shard(ref[2], 1, rank, 2), ref[3]]
        got = _step(layer, x_local, dy_local)
        if not column and sp:  # the replicated bias saw only this rank's sequence chunk
            all_reduce_sequence_parallel_grads(layer.parameters(), g)
        for a, e in zip(got, want):
            worst = max(worst, ((a - e).abs().max() / e.abs().max()).item())
        update_fp8_scales(ref_layer)
        update_fp8_scales(layer)
    if recipe_name == "delayed" and reduce_amax:
        torch.testing.assert_close(layer.gemm.scale, ref_layer.gemm.scale, rtol=0, atol=0)
    return worst


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("sp", [False, True])
def test_tp2_fp8_linear_equals_single_process(kind, recipe, sp):
    worst = run_ranks(2, check_tp_fp8_linear, kind, recipe, sp, True)
    assert max(worst) < 1e-5, f"TP2 FP8 {kind} linear differs from one process by {max(worst):.3g}"


# block-scaled recipes: shards whose sizes are multiples of the block hold exactly the unsharded blocks
# (mxfp8: 32, blockwise: 128 x 128 weight tiles), so no scale is reduced and the results are the same
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("recipe, dims", [("mxfp8", (64, 128)), ("blockwise", (256, 256))])
def test_tp2_block_scaled_fp8_linear_equals_single_process(kind, recipe, dims):
    worst = run_ranks(2, check_tp_fp8_linear, kind, recipe, True, False, dims)
    assert max(worst) < 1e-5, f"TP2 {recipe} {kind} linear differs from one process by {max(worst):.3g}"


@pytest.mark.parametrize("kind", ["column", "row"])
def test_without_amax_reduction_shards_disagree(kind):
    worst = run_ranks(2, check_tp_fp8_linear, kind, "delayed", False, False)
    assert max(worst) > 1e-3, "control: per-shard scales should quantise differently"


def check_dp_amax_reduction():
    state = cached_state(tp=1)  # two data-parallel replicas
    gemm = Fp8Gemm(Fp8Recipe(format="hybrid"))
    x = _rand((S, B, IN), 30 + state.dp_rank, 1.0 + 3 * state.dp_rank)  # rank 1 sees larger inputs
    w = _rand((OUT, IN), 1, 0.05).requires_grad_()
    gemm(x, w).backward(_rand((S, B, OUT), 40 + state.dp_rank, 1e-3))
    local = gemm.amax_history[0].clone()
    update_fp8_scales(gemm, data_parallel_group=state.dp_group)
    return local, gemm.scale.clone()


def test_delayed_scales_agree_over_data_parallel_replicas():
    (amax0, scale0), (amax1, scale1) = run_ranks(2, check_dp_amax_reduction)
    assert not torch.equal(amax0, amax1)  # the replicas saw different data
    torch.testing.assert_close(scale0, scale1, rtol=0, atol=0)
    want = torch.tensor([448.0, 448.0, 57344.0]) / torch.maximum(amax0, amax1)
    torch.testing.assert_close(scale0, want, rtol=1e-6, atol=0)
