"""``--moe-router-padding-for-fp8`` across expert parallelism (gloo, EP 2, two steps).

Each rank pads its own routing map, so every expert receives a multiple of 16 tokens from every
source rank and hence in total. On every rank the padded FP8 layer's output, input gradient and
parameter gradients equal the unpadded FP8 layer's at the same EP 2 (rtol 1e-5: fp32 summation
order), and so do the FP8 scales after each step's update. tensorwise and delayed scaling: their
scales depend only on the amaxes, which zero padding rows leave alone (the block recipes' token
blocks are cut at each source rank's padded chunk, so their weight gradients differ from the
unpadded EP 2 run by FP8 rounding; in one process they are exact: tests/unit/test_moe_fp8_padding.py).
"""

import pytest
import torch

from megatron_lite.moe.layer import MoELayer
from megatron_lite.precision.fp8 import fp8_gemms, update_fp8_scales
from tests.harness import cached_state, run_ranks
from tests.moe_helpers import moe_config

S, B, H = 16, 2, 32


def _layer(state, recipe, padding):
    config = moe_config(hidden_size=H, moe_ffn_hidden_size=32, num_experts=4, swiglu=True, init_method_std=0.05,
                        expert_model_parallel_size=2, fp8="hybrid", fp8_recipe=recipe, moe_grouped_gemm=True,
                        moe_router_padding_for_fp8=padding)
    layer = MoELayer(config, state, 1)
    counts = []
    forward = layer.experts.forward
    layer.experts.forward = lambda x, p, tokens: counts.append(list(tokens)) or forward(x, p, tokens)
    return layer, counts


def check_ep2_padding(recipe):
    state = cached_state(ep=2)
    plain, plain_counts = _layer(state, recipe, False)
    padded, padded_counts = _layer(state, recipe, True)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + state.rank)
        x = (torch.randn(S, B, H, generator=g) * (1 + step))
        dy = torch.randn(S, B, H, generator=g)
        results = []
        for layer in (plain, padded):
            layer.zero_grad()
            xr = x.clone().requires_grad_()
            out = layer(xr)
            out.backward(dy)
            results.append([out.detach(), xr.grad] + [p.grad for p in layer.parameters()])
            update_fp8_scales(layer, expert_data_parallel_group=state.expert_dp_group)
        for i, (a, b) in enumerate(zip(results[1], results[0])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item(), msg=f"step {step} tensor {i}")
        for a, b in zip(fp8_gemms(padded), fp8_gemms(plain)):
            assert a.scale.equal(b.scale)
    assert all(c % 16 == 0 for counts in padded_counts for c in counts), padded_counts
    assert any(c % 16 for counts in plain_counts for c in counts)
    return sum(map(sum, padded_counts)) > sum(map(sum, plain_counts))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_ep2_padded_fp8_layer_equals_unpadded(recipe):
    assert all(run_ranks(2, check_ep2_padding, recipe))
