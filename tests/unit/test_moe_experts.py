"""Experts: the grouped GEMM equals the sequential loop (outputs and every gradient), and each
expert computes ``p * expert(x)`` from its seeded master weights. fp32, rtol 1e-5 / atol 1e-6."""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.moe.experts import (
    GroupedExperts,
    SequentialExperts,
    grouped_matmul,
    grouped_mm_available,
    padded_batched_matmul,
)
from megatron_lite.parallel.state import ParallelState
from tests.moe_helpers import moe_config


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _pair(**overrides):
    config = moe_config(num_experts=8, **overrides)
    state = ParallelState()
    return config, SequentialExperts(config, state, 1), GroupedExperts(config, state, 1)


@pytest.mark.parametrize("swiglu,bias", [(False, False), (True, False), (False, True), (True, True)])
def test_grouped_equals_sequential(swiglu, bias):
    config, seq, grp = _pair(swiglu=swiglu, add_bias_linear=bias)
    with torch.no_grad():  # non-zero biases, the same in both
        for j, expert in enumerate(seq.local_experts):
            if bias:
                expert.linear_fc1.bias.normal_()
                expert.linear_fc2.bias.normal_()
                grp.bias1[j].copy_(expert.linear_fc1.bias)
                grp.bias2[j].copy_(expert.linear_fc2.bias)
    tokens = [3, 0, 5, 1, 0, 2, 4, 2]  # empty experts included; 17 rows (not a multiple of 4)
    torch.manual_seed(0)
    x = torch.randn(sum(tokens), config.hidden_size)
    probs = torch.rand(sum(tokens))
    dy = torch.randn(sum(tokens), config.hidden_size)
    results = []
    for module in (seq, grp):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = module(xi, pi, tokens)
        y.backward(dy)
        results.append((y, xi.grad, pi.grad))
    for a, b in zip(*results):
        _close(a, b)
    for j, expert in enumerate(seq.local_experts):
        _close(grp.weight1.grad[j], expert.linear_fc1.weight.grad.t())
        _close(grp.weight2.grad[j], expert.linear_fc2.weight.grad.t())
        if bias:
            _close(grp.bias1.grad[j], expert.linear_fc1.bias.grad)
            _close(grp.bias2.grad[j], expert.linear_fc2.bias.grad)


def test_each_expert_is_its_master_mlp_weighted_after_the_activation():
    config, seq, _ = _pair(swiglu=True)
    tokens = [2] * 8
    x, probs = torch.randn(16, config.hidden_size), torch.rand(16)
    y = seq(x, probs, tokens)
    for e in range(8):
        fc1 = torch.empty(2 * config.moe_ffn_hidden_size, config.hidden_size)
        config.init_method(1, f"mlp.experts.{e}.linear_fc1.weight")(fc1)
        fc2 = torch.empty(config.hidden_size, config.moe_ffn_hidden_size)
        config.init_method(1, f"mlp.experts.{e}.linear_fc2.weight", scaled=True)(fc2)
        rows = slice(2 * e, 2 * e + 2)
        gate, up = F.linear(x[rows], fc1).chunk(2, dim=-1)
        _close(y[rows], F.linear(F.silu(gate) * up * probs[rows, None], fc2))


def test_expert_parameters_are_marked():
    _, seq, grp = _pair()
    for module in (seq, grp):
        for p in module.parameters():
            assert p.is_expert and p.allreduce  # EP == 1: reduced like dense weights


@pytest.mark.parametrize("shape", [(6, 8), (8, 12), (5, 7)])
def test_grouped_matmul_paths_equal_per_expert_matmul(shape):
    """Both kernels (``torch._grouped_mm`` when the shapes are 16-byte aligned, else the padded
    bmm) give the per-expert products and their gradients."""
    torch.manual_seed(1)
    k, m = shape
    tokens = [0, 4, 1, 2]
    x, w, dy = torch.randn(7, k), torch.randn(4, k, m), torch.randn(7, m)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.cat([a @ wr[j] for j, a in enumerate(xr.split(tokens))]).backward(dy)
    for fn in (grouped_matmul, padded_batched_matmul):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, tokens)
        y.backward(dy)
        _close(y, torch.cat([a @ w[j] for j, a in enumerate(x.split(tokens))]))
        _close(xi.grad, xr.grad)
        _close(wi.grad, wr.grad)
    assert grouped_mm_available(x, w) == (hasattr(torch, "_grouped_mm") and k % 4 == 0 and m % 4 == 0)


def test_grouped_matmul_with_no_rows():
    """A rank whose local experts received no token: empty output, zero weight gradient."""
    x = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(2, 8, 16, requires_grad=True)
    y = grouped_matmul(x, w, [0, 0])
    assert y.shape == (0, 16)
    y.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() == 0


@pytest.mark.parametrize("flags", [dict(openai_gelu=True), dict(add_bias_linear=True, bias_activation_fusion=True),
                                   dict()])
def test_gelu_experts_compute_the_dense_mlps_gelu(flags):
    """--openai-gelu (and bias + GeLU fusion, whose kernel is the tanh form) make the dense MLP's GeLU
    the tanh approximation; routed and shared experts must compute the same function (they used the
    erf form whatever the flags)."""
    from megatron_lite.models.mlp import MLP
    from megatron_lite.moe.shared_experts import SharedExperts

    config = moe_config(num_experts=2, ffn_hidden_size=8, moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=8,
                        **flags)
    state = ParallelState()
    dense, shared = MLP(config, state, 1), SharedExperts(config, state, 1)
    routed = [cls(config, state, 1) for cls in (SequentialExperts, GroupedExperts)]
    torch.manual_seed(0)
    x = torch.randn(6, config.hidden_size) * 3  # |x| of a few units: erf and tanh GeLU differ by ~1e-4
    for module in (dense, shared):  # the same weights (zero biases), so all four are one MLP
        with torch.no_grad():
            module.linear_fc1.weight.copy_(routed[0].local_experts[0].linear_fc1.weight)
            module.linear_fc2.weight.copy_(routed[0].local_experts[0].linear_fc2.weight)
    expected = dense(x[:, None])[:, 0]
    fc1, fc2 = routed[0].local_experts[0].linear_fc1.weight, routed[0].local_experts[0].linear_fc2.weight
    tanh = bool(flags)  # the dense MLP's GeLU, by its own rules
    _close(expected, F.linear(F.gelu(F.linear(x, fc1), approximate="tanh" if tanh else "none"), fc2))
    _close(shared(x[:, None])[:, 0], expected)
    for module in routed:
        _close(module(x, torch.ones(6), [6, 0]), expected)


@pytest.mark.parametrize("grouped", [False, True])
def test_expert_biases_get_no_weight_decay(grouped):
    """Biases do not decay (Megatron's rule), also the grouped experts' stacked [E, n] ones: a step
    with zero gradients leaves them as they are and shrinks only the weights."""
    from megatron_lite.config import OptimizerConfig
    from megatron_lite.optim.optimizer import MegatronOptimizer

    config, seq, grp = _pair(add_bias_linear=True)
    module = grp if grouped else seq
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(1.0)
            p.main_grad = torch.zeros_like(p)
    MegatronOptimizer([module], ParallelState(), OptimizerConfig(lr=0.1, weight_decay=0.5, clip_grad=0)).step()
    for name, p in module.named_parameters():
        expected = 1.0 if "bias" in name else 1.0 - 0.1 * 0.5
        assert torch.allclose(p, torch.full_like(p, expected)), (name, p)


def test_checkpoint_with_stacked_biases_in_the_decay_group_loads():
    """A checkpoint saved while the stacked expert biases sat with the matrices (every param of more
    than one dimension first in torch's indices) loads: each param gets its own Adam moments back,
    and the biases land in the no-decay group."""
    from megatron_lite.config import OptimizerConfig
    from megatron_lite.optim.optimizer import MegatronOptimizer

    _, _, grp = _pair(add_bias_linear=True)
    names = {id(p): n for n, p in grp.named_parameters()}
    for p in grp.parameters():
        p.main_grad = torch.randn_like(p)
    oc = OptimizerConfig(lr=0.1, weight_decay=0.5, clip_grad=0)
    opt = MegatronOptimizer([grp], ParallelState(), oc)
    opt.step()
    moments = {names[id(p)]: opt.optimizer.state[m]["exp_avg"].clone() for p, m in zip(opt.model_params, opt.masters)}
    params = opt.model_params
    legacy = [p for p in params if p.dim() > 1] + [p for p in params if p.dim() <= 1]
    sd = opt.state_dict()
    group = dict(sd["optimizer"]["param_groups"][0], params=list(range(len(legacy))))
    sd["optimizer"] = {"state": {i: {"step": torch.tensor(1.0), "exp_avg": moments[names[id(p)]],
                                     "exp_avg_sq": moments[names[id(p)]].square()} for i, p in enumerate(legacy)},
                       "param_groups": [group]}
    fresh = MegatronOptimizer([grp], ParallelState(), oc)
    fresh.load_state_dict(sd)
    for p, m in zip(fresh.model_params, fresh.masters):
        assert torch.equal(fresh.optimizer.state[m]["exp_avg"], moments[names[id(p)]]), names[id(p)]
    assert [g["weight_decay"] for g in fresh.param_groups] == [0.5, 0.0]
    assert {names[id(p)] for p in fresh.param_groups[1]["params"]} == {"bias1", "bias2"}
