"""Router, routing functions and auxiliary losses against independent references on crafted logits.

References are written out with explicit loops over tokens and experts (not the library's
vectorised formulas). fp32 throughout; tolerances rtol 1e-6 unless stated.
"""

import math

import pytest
import torch

from megatron_lite.moe.aux_loss import attach_loss
from megatron_lite.moe.router import TopKRouter
from megatron_lite.moe.routing import (
    drop_to_capacity,
    expert_capacity,
    group_limited_topk,
    sinkhorn,
    sinkhorn_routing,
    topk_routing,
)
from megatron_lite.parallel.state import ParallelState
from tests.moe_helpers import moe_config


def _close(a, b, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(torch.as_tensor(a).float(), torch.as_tensor(b).float(), rtol=rtol, atol=atol)


def _router(**overrides):
    config = moe_config(**overrides)
    router = TopKRouter(config, ParallelState(), 1)
    router.train()
    return router


def _with_logits(router, logits):
    """Make the router produce exactly ``logits`` for a [T, 1, E] identity-like input."""
    tokens, experts = logits.shape
    assert router.weight.shape == (experts, experts)
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
    return logits.reshape(tokens, 1, experts).clone().requires_grad_()


def _reference_balancing(logits, topk, coeff):
    """coeff * E * sum_i f_i * P_i, with a loop over tokens (softmax over all experts, plain top-k)."""
    tokens, experts = logits.shape
    f = [0.0] * experts
    p = [0.0] * experts
    for t in range(tokens):
        scores = torch.softmax(logits[t].double(), dim=0)
        for i in scores.topk(topk).indices.tolist():
            f[i] += 1.0 / (tokens * topk)
        for i in range(experts):
            p[i] += scores[i].item() / tokens
    return coeff * experts * sum(fi * pi for fi, pi in zip(f, p))


def test_balanced_routing_gives_the_coefficient():
    # token t prefers experts t and t+1 (mod 4) equally strongly: every expert gets the same share
    experts, coeff = 4, 0.01
    logits = torch.zeros(8, experts)
    for t in range(8):
        logits[t, t % experts] = 2.0
        logits[t, (t + 1) % experts] = 2.0
    router = _router(hidden_size=experts, num_experts=experts, moe_aux_loss_coeff=coeff)
    router(_with_logits(router, logits))
    _close(router.metrics["load_balancing_loss"] * coeff, coeff)


def test_unbalanced_aux_loss_matches_reference_and_gradient_scale():
    torch.manual_seed(0)
    logits = torch.randn(10, 6) * 2
    coeff, scale = 0.1, 0.25
    router = _router(hidden_size=6, num_experts=6, moe_aux_loss_coeff=coeff)
    router.aux_loss_backward_scale = scale
    x = _with_logits(router, logits)
    probs, _ = router(x)
    _close(router.metrics["load_balancing_loss"] * coeff, _reference_balancing(logits, 2, coeff))
    probs.sum().backward()
    # the gradient of the aux term alone: d(scale * L_aux)/dx, L_aux built from differentiable ops
    x2 = x.detach().clone().requires_grad_()
    scores = torch.softmax(x2.view(10, 6), dim=-1)
    routed = torch.zeros(10, 6).scatter(1, scores.topk(2).indices, 1.0)
    aux = coeff * 6 / (2 * 10 * 10) * (scores.sum(0) * routed.sum(0)).sum()
    probs2, _ = topk_routing(x2.view(10, 6), 2)
    (probs2.sum() + scale * aux).backward()
    _close(x.grad, x2.grad, rtol=1e-5, atol=1e-7)


def test_z_loss_equals_its_formula():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [-1.0, 0.0, 4.0, 2.0], [0.3, 0.3, 0.3, 0.3]])
    router = _router(hidden_size=4, moe_z_loss_coeff=1e-3)
    router(_with_logits(router, logits))
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 3
    _close(router.metrics["z_loss"], expected)


def test_seq_aux_loss_is_the_mean_over_sequences():
    torch.manual_seed(1)
    s, b, experts, coeff = 5, 3, 4, 0.01
    logits = torch.randn(s, b, experts) * 2
    router = _router(hidden_size=experts, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=coeff)
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
    router(logits.clone().requires_grad_())
    expected = sum(_reference_balancing(logits[:, i], 2, coeff) for i in range(b)) / b
    _close(router.metrics["seq_load_balancing_loss"] * coeff, expected)


def test_global_aux_loss_averages_counts_over_micro_batches_and_resets():
    torch.manual_seed(2)
    experts, coeff = 4, 0.01
    mb = [torch.randn(6, experts) * 2 for _ in range(2)]
    router = _router(hidden_size=experts, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=coeff)
    values = []
    for logits in mb:
        before = router.metrics.get("global_load_balancing_loss", torch.tensor(0.0)).clone()
        router(_with_logits(router, logits))
        values.append((router.metrics["global_load_balancing_loss"] - before) * coeff)

    def counts(logits):
        return torch.zeros(6, experts).scatter(1, torch.softmax(logits, -1).topk(2).indices, 1.0).sum(0)

    for i, logits in enumerate(mb):
        mean_counts = sum(counts(m) for m in mb[: i + 1]) / (i + 1)
        p = torch.softmax(logits, -1).sum(0)
        _close(values[i], coeff * experts / (2 * 36) * (p * mean_counts).sum(), rtol=1e-5)
    router.finish_step()
    assert router.global_steps == 0 and router.global_tokens_per_expert.abs().sum() == 0


def test_topk_variants_against_references():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 2.9, -2.0]])
    # post-softmax: softmax over the two selected logits
    probs, rmap = topk_routing(logits, 2)
    _close(probs[0, [1, 3]], torch.softmax(torch.tensor([2.0, 1.5]), 0))
    assert rmap.tolist() == [[False, True, False, True], [True, False, True, False]]
    # pre-softmax: the selected entries of the full softmax, times the scaling factor
    probs, _ = topk_routing(logits, 2, pre_softmax=True, scaling_factor=2.5)
    _close(probs[1, [0, 2]], 2.5 * torch.softmax(logits[1], 0)[[0, 2]])
    # sigmoid with expert bias: selection on sigmoid + bias, weights normalised sigmoid (no bias)
    bias = torch.tensor([0.0, -5.0, 0.0, 0.0])
    probs, rmap = topk_routing(logits, 2, score_function="sigmoid", expert_bias=bias)
    sel = torch.sigmoid(logits[0, [3, 0]])
    assert rmap[0].tolist() == [True, False, False, True]
    _close(probs[0, [3, 0]], sel / sel.sum())


def test_group_limited_routing_keeps_the_best_groups():
    # 8 experts in 4 groups of 2. With topk 2 / group_topk 2 a group scores its best expert:
    # [0.9, 0.8, 0.7, 0.75] -> groups 0 and 1 -> experts 0 and 2
    scores = torch.tensor([[0.9, 0.0, 0.8, 0.0, 0.7, 0.6, 0.75, 0.2]])
    values, indices = group_limited_topk(scores, topk=2, num_groups=4, group_topk=2)
    assert sorted(indices[0].tolist()) == [0, 2]
    values, indices = group_limited_topk(scores, topk=4, num_groups=4, group_topk=2)
    # per group: sum of the top-2 -> [0.9, 0.8, 1.3, 0.95]: groups 2 and 3 win
    assert sorted(indices[0].tolist()) == [4, 5, 6, 7]


@pytest.mark.parametrize("losses", [dict(moe_aux_loss_coeff=0.01), dict(moe_z_loss_coeff=1e-3),
                                    dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01)])
def test_per_token_loss_gives_router_losses_their_usual_weight(losses):
    """--calculate-per-token-loss divides every gradient by the batch's token count (one micro-batch,
    one rank here: T) instead of by the micro-batches: the router losses' gradient, divided by T, is
    what it is without the flag. (They were not multiplied by T: load balancing T times too weak.)"""
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    grads, logged = [], []
    for per_token in (False, True):
        router = _router(hidden_size=4, calculate_per_token_loss=per_token, **losses)
        x = _with_logits(router, logits)
        probs, _ = router(x)
        (probs * 0).sum().backward()  # only the attached losses' gradients reach x
        grads.append(x.grad.clone())
        logged.append({k: v.item() for k, v in router.metrics.items()})
    tokens = logits.shape[0]
    assert grads[0].abs().sum() > 0
    _close(grads[1] / tokens, grads[0])
    assert logged[0] == logged[1]  # the logged values do not change


def test_expert_bias_update():
    router = _router(hidden_size=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.1)
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]] * 3 + [[0.0, 2.0, 3.0, -1.0]])
    router(_with_logits(router, logits))
    assert router.local_tokens_per_expert.tolist() == [3, 4, 1, 0]
    router.finish_step()
    _close(router.expert_bias, [-0.1, -0.1, 0.1, 0.1])
    assert router.local_tokens_per_expert.abs().sum() == 0


@pytest.mark.parametrize("pad", [False, True])
def test_expert_bias_counts_the_routers_choice_before_the_capacity_limit(pad):
    """Capacity 1 (factor 0.5) caps the counts [3, 2, 2, 1] at [1, 1, 1, 1] (dropping) and padding fills
    every expert to exactly 1: counted after the limit, no bias would move. The bias balances the
    router's own selection, so it counts that: expert 0 goes down, expert 3 up."""
    router = _router(hidden_size=4, moe_router_topk=1, moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1,
                     moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=pad)
    logits = torch.tensor([[3.0, 0, 0, 0]] * 3 + [[0, 3.0, 0, 0]] * 2 + [[0, 0, 3.0, 0]] * 2 + [[0, 0, 0, 3.0]])
    _, rmap = router(_with_logits(router, logits))
    assert rmap.sum(0).tolist() == [1, 1, 1, 1]  # what the experts receive
    assert router.local_tokens_per_expert.tolist() == [3, 2, 2, 1]
    router.finish_step()
    _close(router.expert_bias, [-0.1, 0, 0, 0.1])


def test_capacity_dropping_by_probs_and_position():
    probs = torch.tensor([[0.6, 0.4, 0, 0], [0.7, 0, 0.3, 0], [0.9, 0, 0, 0.1], [0, 0.5, 0.5, 0]])
    rmap = probs > 0
    assert expert_capacity(4, 4, 2, 1.0) == 2
    assert expert_capacity(5, 4, 2, 1.0) == 3  # ceil(5 x 2 / 4) = ceil(2.5): rounded up
    assert expert_capacity(3, 2, 2, 4.0) == 3  # at most every token
    p, m, dropped = drop_to_capacity(probs, rmap, 2, policy="probs")
    assert dropped == 1 and m[:, 0].tolist() == [False, True, True, False]
    _close(p[0], [0, 0.4, 0, 0])
    p, m, dropped = drop_to_capacity(probs, rmap, 2, policy="position")
    assert dropped == 1 and m[:, 0].tolist() == [True, True, False, False]
    p, m, _ = drop_to_capacity(probs, rmap, 2, policy="probs", pad_to_capacity=True)
    assert m.sum(0).tolist() == [2, 2, 2, 2]
    _close(p[:, 3], [0, 0, 0.1, 0])  # padding slots carry weight 0
    with pytest.raises(ValueError, match="drop policy"):
        drop_to_capacity(probs, rmap, 2, policy="random")


def test_sinkhorn_balances_and_routes():
    torch.manual_seed(3)
    logits = torch.randn(8, 4)
    balanced = sinkhorn(logits, tol=1e-8)
    _close(balanced.sum(0), torch.full((4,), 0.25), rtol=1e-4, atol=1e-6)
    _close(balanced.sum(1), torch.full((8,), 1 / 8), rtol=1e-3, atol=1e-5)
    probs, rmap = sinkhorn_routing(logits, 1, training=True)
    chosen = balanced.argmax(1)
    assert rmap.float().argmax(1).tolist() == chosen.tolist()
    _close(probs.sum(1), torch.sigmoid(logits).gather(1, chosen[:, None]).squeeze(1))


def test_attach_loss_passes_activation_and_scales_the_loss_gradient():
    a = torch.randn(3, requires_grad=True)
    w = torch.tensor(2.0, requires_grad=True)
    out = attach_loss(a * 1.0, w * w, scale=0.5)
    (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    _close(a.grad, [1.0, 2.0, 3.0])
    _close(w.grad, 0.5 * 2 * 2.0)


def test_router_dtype_fp64_and_jitter_only_in_training():
    router = _router(hidden_size=4, moe_router_dtype="fp64", moe_input_jitter_eps=0.1)
    x = torch.randn(5, 1, 4)
    assert router.gating(x).dtype == torch.float64
    router.eval()
    _close(router.gating(x), router.gating(x))
    router.train()
    assert not torch.equal(router.gating(x), router.gating(x))
