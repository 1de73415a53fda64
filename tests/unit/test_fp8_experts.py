"""FP8 expert GEMMs: each expert's fc1/fc2 through its own Fp8Gemm.

* Sequential and grouped experts in FP8 compute the same thing (the same per-expert FP8 GEMMs on
  the same quantised values: outputs and every gradient to 1e-6), and both follow the fp32
  experts within FP8 tolerance: relative error of the output below 8% (measured 5-7%), of the
  gradients below 25% (measured 4-20%: they pass two E5M2 GEMMs, fc2's dgrad then fc1's, and an
  expert with 5 tokens has a noisy weight gradient), while not being fp32 (error above 1e-4).
* No GEMM falls back to a dequantised matmul, although the token counts (5, 9, 18) are not
  multiples of 16: the weight-gradient GEMM pads its token dimension with zero rows.
* Each expert has its own scales (weights with different magnitudes get different weight scales).
* An expert that receives no token runs an empty GEMM: its input and gradient amaxes are 0, so its
  scales stay at their previous value (finite, never a division by zero).
* ``--first-last-layers-bf16`` keeps the experts of the bf16 layers out of FP8.
"""

import pytest
import torch

from megatron_lite.moe.experts import GroupedExperts, SequentialExperts
from megatron_lite.parallel.state import ParallelState
from megatron_lite.precision.fp8 import GRAD_OUTPUT, INPUT, WEIGHT, Fp8Gemm, fp8_gemms, update_fp8_scales
from tests.moe_helpers import moe_config

TOKENS = [5, 0, 9, 18]  # expert 1 gets no token
H, FFN = 32, 64


def _config(fp8="hybrid", **overrides):
    return moe_config(hidden_size=H, moe_ffn_hidden_size=FFN, num_experts=4, fp8=fp8, init_method_std=0.05,
                      **overrides)


def _experts(cls, config, scale_expert=None):
    module = cls(config, ParallelState(), 1)
    if scale_expert is not None:  # expert 3's weights 4x larger: its weight scale must differ
        with torch.no_grad():
            for p in module.parameters():
                if p.dim() == 3:
                    p[3].mul_(4.0)
                elif any(p is e.linear_fc1.weight or p is e.linear_fc2.weight for e in module.local_experts[3:]):
                    p.mul_(4.0)
    return module


def _step(module, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(TOKENS), H, generator=g).requires_grad_()
    probs = torch.rand(sum(TOKENS), generator=g).requires_grad_()
    dy = torch.randn(sum(TOKENS), H, generator=g) * 1e-2
    module.zero_grad()
    y = module(x, probs, TOKENS)
    y.backward(dy)
    grads = [p.grad.clone() for p in module.parameters()]
    return [y.detach(), x.grad, probs.grad] + grads


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _grouped_grads_as_sequential(results):
    """Grouped weight grads [E, in, out] -> per-expert [out, in] in the sequential parameter order."""
    y, dx, dp, w1, w2 = results
    per_expert = [t for j in range(w1.shape[0]) for t in (w1[j].t(), w2[j].t())]
    return [y, dx, dp] + per_expert


@pytest.mark.parametrize("swiglu", [False, True])
def test_fp8_experts_follow_fp32_and_grouped_equals_sequential(swiglu):
    fp32 = _experts(SequentialExperts, _config(fp8=None, swiglu=swiglu), scale_expert=3)
    seq = _experts(SequentialExperts, _config(swiglu=swiglu), scale_expert=3)
    grp = _experts(GroupedExperts, _config(swiglu=swiglu), scale_expert=3)
    assert len(fp8_gemms(seq)) == len(fp8_gemms(grp)) == 2 * 4
    assert all(g.expert for g in fp8_gemms(grp))
    for step in range(3):  # delayed scaling: step 0 casts with scale 1, later steps with learned scales
        ref = _step(fp32, step)
        got_seq = _step(seq, step)
        got_grp = _grouped_grads_as_sequential(_step(grp, step))
        for a, b in zip(got_seq, got_grp):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        if step > 0:
            for i, (a, b) in enumerate(zip(got_seq, ref)):
                if b.norm() > 0:  # (the empty expert's gradients are zero in all three)
                    bound = 0.08 if i == 0 else 0.25  # output / gradients (two chained E5M2 GEMMs)
                    assert 1e-4 < _rel(a, b) < bound, f"step {step} tensor {i}: {_rel(a, b)}"
        update_fp8_scales(seq)
        update_fp8_scales(grp)
    assert not any(g.fallbacks for g in fp8_gemms(seq) + fp8_gemms(grp))  # every GEMM ran the FP8 path
    for s, g in zip(fp8_gemms(seq), fp8_gemms(grp)):
        torch.testing.assert_close(s.scale, g.scale)
    fc1 = [e.linear_fc1.gemm for e in grp.local_experts]
    assert fc1[3].scale[WEIGHT] < 0.5 * fc1[0].scale[WEIGHT]  # expert 3's own (4x larger) weight scale


def test_zero_token_expert_keeps_its_scales():
    grp = _experts(GroupedExperts, _config())
    _step(grp, 0)
    update_fp8_scales(grp)
    for fc in (grp.local_experts[1].linear_fc1.gemm, grp.local_experts[1].linear_fc2.gemm):
        assert fc.scale[INPUT] == 1.0 and fc.scale[GRAD_OUTPUT] == 1.0  # no token: previous scale kept
        assert torch.isfinite(fc.scale).all() and fc.scale[WEIGHT] > 1.0  # the weight still has an amax
        assert torch.isfinite(fc.amax_history).all()
    busy = grp.local_experts[2].linear_fc1.gemm
    assert busy.scale[INPUT] != 1.0 and busy.scale[GRAD_OUTPUT] != 1.0


@pytest.mark.parametrize("cls", [SequentialExperts, GroupedExperts])
def test_first_last_layers_bf16_keeps_those_experts_out_of_fp8(cls):
    config = _config(num_layers=3, first_last_layers_bf16=True)
    for layer, fp8 in ((1, False), (2, True), (3, False)):
        gemms = fp8_gemms(cls(config, ParallelState(), layer))
        assert len(gemms) == (8 if fp8 else 0)
        assert all(isinstance(g, Fp8Gemm) and g.expert for g in gemms)


def test_expert_fp8_state_names_are_checkpoint_keys():
    """Both kinds name their FP8 state local_experts.{j}.linear_fc{1,2}.gemm.*: a checkpoint merges
    them per expert across expert-parallel ranks, and the conversion tools drop them."""
    from megatron_lite.precision.fp8 import is_fp8_state_key
    for cls in (SequentialExperts, GroupedExperts):
        keys = [k for k in cls(_config(), ParallelState(), 1).state_dict() if is_fp8_state_key(k)]
        assert sorted(keys) == sorted(f"local_experts.{j}.linear_fc{i}.gemm.{n}" for j in range(4)
                                      for i in (1, 2) for n in ("amax_history", "scale"))


def test_empty_and_padded_gemm_pieces():
    from megatron_lite.precision.fp8_ops import E4M3, fp8_matmul, pad_rows
    one = torch.tensor(1.0)
    a = torch.randn(0, 32).to(E4M3)
    out, reason = fp8_matmul(a, torch.randn(16, 32).to(E4M3).t(), one, one, torch.float32)
    assert out.shape == (0, 16) and reason is None
    out, reason = fp8_matmul(torch.randn(16, 0).to(E4M3), a, one, one, torch.float32)  # an empty expert's wgrad
    assert torch.equal(out, torch.zeros(16, 32)) and reason is None
    x = torch.randn(5, 32).to(E4M3)
    padded = pad_rows(x, 16)
    assert padded.shape == (16, 32) and torch.equal(padded[:5].float(), x.float()) and not padded[5:].float().any()
    assert pad_rows(padded, 16) is padded
