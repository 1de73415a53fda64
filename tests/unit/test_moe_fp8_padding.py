"""``--moe-router-padding-for-fp8``: every expert's token count padded to the FP8 alignment.

* :func:`pad_routing_map` keeps every routed slot, adds the earliest unrouted tokens and makes each
  column a multiple (or every token, on a rank with too few).
* An FP8 MoE layer with padding equals the same layer without it, for every recipe: the output,
  the input gradient and every parameter gradient to rtol 1e-5 (fp32 summation order: the padding
  rows are zero and add nothing), and after two delayed-scaling steps the amax histories and scales
  are identical (zero rows change no amax). Meanwhile every expert received a multiple of the
  recipe's alignment (16 delayed/tensorwise, 32 mxfp8, 128 blockwise), so the weight-gradient
  GEMM's own zero-row padding (``pad_rows``) has nothing to add.
* The refusals (no FP8, no experts, the allgather dispatcher) are one line naming the flag.
"""

import pytest
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.moe.layer import MoELayer
from megatron_lite.moe.routing import pad_routing_map
from megatron_lite.parallel.state import ParallelState
from megatron_lite.precision.fp8 import fp8_gemms, update_fp8_scales
from megatron_lite.precision.fp8_ops import pad_rows
from tests.moe_helpers import moe_config

S, B, H = 64, 2, 32  # 128 tokens: a whole blockwise block, so every padded count can reach a multiple
ALIGN = {"delayed": 16, "tensorwise": 16, "mxfp8": 32, "blockwise": 128}


def test_pad_routing_map_keeps_routes_and_pads_with_the_earliest_free_tokens():
    g = torch.Generator().manual_seed(0)
    routing_map = torch.rand(40, 5, generator=g) < torch.tensor([0.05, 0.3, 0.5, 0.9, 0.0])
    padded = pad_routing_map(routing_map, 8)
    assert (padded | routing_map).equal(padded)  # nothing routed is lost
    counts = padded.sum(0)
    assert (counts % 8 == 0).all() and counts[4] == 0  # an expert without tokens gets no padding
    for e in range(5):
        added = (padded[:, e] & ~routing_map[:, e]).nonzero().flatten()
        free = (~routing_map[:, e]).nonzero().flatten()
        assert added.equal(free[: len(added)])  # the earliest tokens not routed to e
        assert len(added) == (-int(routing_map[:, e].sum())) % 8
    few = pad_routing_map(routing_map[:6], 8)  # 6 tokens cannot make 8: an expert gets all it can
    assert ((few.sum(0) == 6) | (few.sum(0) == 0)).all()


def _layer(recipe, padding, swiglu=True, bias=False):
    config = moe_config(hidden_size=H, moe_ffn_hidden_size=32, num_experts=4, moe_router_topk=2, swiglu=swiglu,
                        add_bias_linear=bias, init_method_std=0.05, fp8="hybrid", fp8_recipe=recipe,
                        fp8_amax_history_len=2, fp8_amax_compute_algo="max", moe_grouped_gemm=True,
                        moe_router_padding_for_fp8=padding)
    layer = MoELayer(config, ParallelState(world_size=1, rank=0), 1)
    counts = []
    forward = layer.experts.forward
    layer.experts.forward = lambda x, p, tokens: counts.append(list(tokens)) or forward(x, p, tokens)
    return layer, counts


def _step(layer, step):
    g = torch.Generator().manual_seed(step)
    x = (torch.randn(S, B, H, generator=g) * (1 + step)).requires_grad_()
    dy = torch.randn(S, B, H, generator=g)
    layer.zero_grad()
    out = layer(x)
    out.backward(dy)
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("recipe", list(ALIGN))
def test_padded_fp8_layer_equals_unpadded(recipe):
    plain, plain_counts = _layer(recipe, False)
    padded, padded_counts = _layer(recipe, True, bias=False)
    assert padded.token_dispatcher.pad_multiple == ALIGN[recipe] and plain.token_dispatcher.pad_multiple is None
    for step in range(2):  # step 1 casts with the scales learned from step 0 (delayed)
        want, got = _step(plain, step), _step(padded, step)
        for i, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item(), msg=f"tensor {i}")
        update_fp8_scales(plain)
        update_fp8_scales(padded)
    for a, b in zip(fp8_gemms(padded), fp8_gemms(plain)):
        assert a.amax_history.equal(b.amax_history) and a.scale.equal(b.scale)
    assert any(c % ALIGN[recipe] for counts in plain_counts for c in counts)  # (unpadded counts are not aligned)
    for counts in padded_counts:
        assert all(c % ALIGN[recipe] == 0 for c in counts), counts
        assert sum(counts) > sum(plain_counts[0])  # padding was added
        rows = torch.zeros(counts[0], 3)
        assert pad_rows(rows, 16) is rows  # the wgrad GEMM's own padding adds nothing


def test_padded_layer_with_biases_and_gelu_equals_unpadded():
    """Padding rows pass fc1's bias and the activation (act(b1) != 0) before their zero weight."""
    plain, _ = _layer("tensorwise", False, swiglu=False, bias=True)
    padded, _ = _layer("tensorwise", True, swiglu=False, bias=True)
    for a, b in zip(_step(padded, 0), _step(plain, 0)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


@pytest.mark.parametrize("overrides, words", [
    (dict(fp8=None), "needs FP8"),
    (dict(num_experts=None), "needs --num-experts"),
    (dict(moe_token_dispatcher_type="allgather"), "--moe-token-dispatcher-type alltoall"),
])
def test_padding_refusals_name_the_flag(overrides, words):
    fields = {**dict(num_experts=4, fp8="hybrid", moe_router_padding_for_fp8=True), **overrides}
    with pytest.raises(ConfigError) as err:
        moe_config(**fields)
    assert "--moe-router-padding-for-fp8" in str(err.value) and words in str(err.value)
    assert "\n" not in str(err.value)


def test_bf16_layers_are_not_padded():
    config = moe_config(num_layers=3, first_last_layers_bf16=True, fp8="hybrid", moe_router_padding_for_fp8=True)
    multiples = [MoELayer(config, ParallelState(world_size=1, rank=0), n).token_dispatcher.pad_multiple
                 for n in (1, 2, 3)]
    assert multiples == [None, 16, None]
