"""The MoE experts' bias + activation fusion (``--bias-gelu-fusion`` / ``--bias-swiglu-fusion``): routed
(sequential and grouped) and shared experts go through the dense MLP's fused functions exactly when the
dense MLP does, and compute what the unfused experts compute with the same GeLU form (tanh): output,
input, routing-weight and every parameter gradient, fp32 within 1e-6, bf16 within a few bf16 roundings."""

import dataclasses

import pytest
import torch

import megatron_lite.fusions.activations as activations
from megatron_lite.arguments import parse_args
from megatron_lite.models import TransformerConfig
from megatron_lite.models.mlp import MLP
from megatron_lite.moe.experts import GroupedExperts, SequentialExperts
from megatron_lite.moe.shared_experts import SharedExperts
from megatron_lite.parallel.state import ParallelState
from tests.moe_helpers import moe_config

TOKENS = [3, 0, 5, 1, 0, 2, 4, 2]  # empty experts included
KINDS = {"gelu_bias": dict(add_bias_linear=True), "swiglu_bias": dict(swiglu=True, add_bias_linear=True),
         "swiglu": dict(swiglu=True)}


def _count_fused_calls(monkeypatch):
    """Count the experts' calls of the fused functions (the names bias_activation_impl looks up when it
    runs; only experts run in these tests)."""
    calls = []
    for name in ("bias_gelu_impl", "bias_swiglu_impl"):
        real = getattr(activations, name)
        monkeypatch.setattr(activations, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    return calls


def _run(module, x, probs, dy, shared: bool):
    """Output and every gradient (input, routing weights, parameters by name) of one backward."""
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = module(xi[:, None])[:, 0] if shared else module(xi, pi, TOKENS)
    y.backward(dy)
    grads = {"x": xi.grad, **({} if shared else {"probs": pi.grad})}
    return y.detach(), {**grads, **{n: p.grad for n, p in module.named_parameters()}}


def _close(actual, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:  # bf16: fc1's bias is added after the GEMM's rounding, not in it: a few roundings of 2^-8 each,
        # relative to the tensor's largest entry (a weight gradient sums the tokens' rounded products)
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-6, atol=2**-6 * scale)


@pytest.mark.parametrize("route", ["native", "function"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cls", [SequentialExperts, GroupedExperts, SharedExperts])
def test_fused_experts_equal_unfused_experts(monkeypatch, cls, kind, dtype, route):
    """``route``: these small calls run PyTorch's own kernels eagerly on a CPU; ``function``: through the
    fused autograd Functions, as large ones do (empty experts included)."""
    if route == "function":
        monkeypatch.setattr(activations, "NATIVE_BELOW", 0)
    shared = cls is SharedExperts
    fused = moe_config(num_experts=8, params_dtype=dtype, bias_activation_fusion=True,
                       moe_shared_expert_intermediate_size=16, **KINDS[kind])
    unfused = dataclasses.replace(fused, bias_activation_fusion=False, openai_gelu=not fused.swiglu)  # tanh GeLU
    state = ParallelState()
    calls = _count_fused_calls(monkeypatch)
    modules = [cls(config, state, 1) for config in (fused, unfused)]
    with torch.no_grad():  # non-zero biases, the same in both
        for p in modules[0].parameters():
            p.add_(torch.randn_like(p, dtype=torch.float32).to(dtype) * 0.5)
    modules[1].load_state_dict(modules[0].state_dict())
    g = torch.Generator().manual_seed(0)
    n = sum(TOKENS)
    x, probs, dy = (torch.randn(n, fused.hidden_size, generator=g).to(dtype), torch.rand(n, generator=g),
                    torch.randn(n, fused.hidden_size, generator=g).to(dtype))
    y, grads = _run(modules[0], x, probs, dy, shared)
    fused_calls = len(calls)
    ref, ref_grads = _run(modules[1], x, probs, dy, shared)
    expected_calls = 1 if shared or cls is GroupedExperts else len(TOKENS)  # the sequential loop: once per expert
    assert fused_calls == expected_calls and len(calls) == fused_calls  # and none unfused
    _close(y, ref, dtype)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _close(grads[name], ref_grads[name], dtype)


@pytest.mark.parametrize("grouped", [False, True])
def test_fused_experts_with_the_activation_recomputed(grouped):
    """--recompute-modules moe_act: the fused activation (fc1's bias an input of the recomputed function:
    the grouped experts' stacked biases and row indices) is freed and computed again, and gives the
    unfused experts' gradients, fc1's bias included."""
    base = moe_config(num_experts=8, moe_grouped_gemm=grouped, add_bias_linear=True, openai_gelu=True)
    recomputed = dataclasses.replace(base, openai_gelu=False, bias_activation_fusion=True,
                                     recompute_granularity="selective", recompute_modules=["moe_act"])
    cls = GroupedExperts if grouped else SequentialExperts
    modules = [cls(config, ParallelState(), 1) for config in (base, recomputed)]
    assert modules[1].recompute_act and modules[1].fused_activation and not modules[0].fused_activation
    with torch.no_grad():
        for p in modules[0].parameters():
            p.add_(torch.randn_like(p))
    modules[1].load_state_dict(modules[0].state_dict())
    x, probs, dy = torch.randn(17, 16), torch.rand(17), torch.randn(17, 16)
    (ref, ref_grads), (y, grads) = (_run(m, x, probs, dy, False) for m in modules)
    _close(y, ref, torch.float32)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _close(grads[name], ref_grads[name], torch.float32)


@pytest.mark.parametrize("flags, fused", [
    ([], True), (["--no-bias-gelu-fusion"], False), (["--openai-gelu", "--no-bias-gelu-fusion"], False),
    (["--disable-bias-linear"], False),  # no bias, no bias + GeLU fusion (Megatron's rule)
    (["--swiglu"], True), (["--swiglu", "--disable-bias-linear"], True),
    (["--swiglu", "--no-bias-swiglu-fusion"], False),
    (["--squared-relu"], False), (["--quick-geglu"], False), (["--swiglu", "--glu-linear-offset", "1.0"], False),
])
def test_the_flags_switch_experts_like_the_dense_mlp(flags, fused):
    argv = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads",
            "2", "--ffn-hidden-size", "32", "--num-experts", "2", "--moe-ffn-hidden-size", "8",
            "--moe-shared-expert-intermediate-size", "8", *flags]
    config = TransformerConfig.from_config(parse_args(argv, world_size=1))
    state = ParallelState()
    assert MLP(config, state, 1).fused_activation == fused
    for cls in (SequentialExperts, GroupedExperts, SharedExperts):
        assert cls(config, state, 1).fused_activation == fused, cls.__name__
