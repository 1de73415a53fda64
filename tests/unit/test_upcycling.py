"""MoE upcycling's rule (megatron_lite/moe/upcycling.py) on tensors, and its flag refusals.

The experts made from a dense MLP, weighted as the router weights them (the ``G`` slices of one copy
share a weight, the selected weights sum to ``m``), add up to the dense MLP exactly (float64 1e-12), gated
or not, with biases; the router rows are shared within each copy. The end-to-end proof (first loss =
the dense loss, EP2, resume) is tests/e2e/test_upcycling.py.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.moe.upcycling import expert_from_dense, share_router_rows
from tests.cli_errors import parse_refused


def _mlp(t, x, gated):
    h = F.linear(x, t["fc1.weight"], t.get("fc1.bias"))
    if gated:
        gate, linear = h.chunk(2, dim=-1)
        h = F.silu(gate) * linear
    else:
        h = F.gelu(h)
    return F.linear(h, t["fc2.weight"], t.get("fc2.bias"))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("granularity, mass", [(1, 1.0), (2, 1.0), (4, 2.5)])
def test_weighted_experts_sum_to_the_dense_mlp(gated, granularity, mass):
    torch.manual_seed(0)
    h, ffn, copies, f64 = 8, 16, 2, torch.float64  # float64: the rule, apart from fp32 rounding
    dense = {"fc1.weight": torch.randn((2 if gated else 1) * ffn, h, dtype=f64),
             "fc1.bias": torch.randn((2 if gated else 1) * ffn, dtype=f64),
             "fc2.weight": torch.randn(h, ffn, dtype=f64), "fc2.bias": torch.randn(h, dtype=f64)}
    x = torch.randn(5, h, dtype=f64)
    experts = [expert_from_dense(dense, e, granularity, gated, mass) for e in range(copies * granularity)]
    assert experts[0]["fc2.weight"].shape == (h, ffn // granularity)
    # a token's weights: one per copy (shared by its slices), summing to m over the selected experts
    per_copy = torch.softmax(torch.randn(copies, dtype=f64), 0) * mass / granularity
    out = sum(per_copy[e // granularity] * _mlp(t, x, gated) for e, t in enumerate(experts))
    torch.testing.assert_close(out, _mlp(dense, x, gated), rtol=1e-12, atol=1e-12)


def test_router_rows_shared_within_each_copy():
    weight = torch.arange(12.0).view(6, 2)
    share_router_rows(weight, 3)
    assert torch.equal(weight, torch.tensor([[0.0, 1.0]] * 3 + [[2.0, 3.0]] * 3))
    same = torch.randn(4, 2)
    kept = same.clone()
    share_router_rows(same, 1)
    assert torch.equal(same, kept)


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2",
        "--lr-warmup-iters", "0"]
UP = ["--num-experts", "4", "--moe-use-upcycling", "--load", "dense"]


@pytest.mark.parametrize("extra, words", [
    (["--moe-upcycling-granularity", "2", "--num-experts", "4"], ["--moe-upcycling-granularity 2", "--moe-use-upcycling"]),
    (["--num-experts", "4", "--moe-use-upcycling"], ["--moe-use-upcycling needs --load"]),
    (UP + ["--ckpt-step", "2"], ["--moe-use-upcycling does not support --ckpt-step", "tracker"]),
    (UP + ["--moe-upcycling-granularity", "0"], ["--moe-upcycling-granularity 0", "positive"]),
    (UP + ["--moe-upcycling-granularity", "4"], ["--moe-upcycling-granularity 4", "--moe-router-topk 2"]),
    (UP + ["--moe-shared-expert-intermediate-size", "16"], ["--moe-shared-expert-intermediate-size"]),
    (UP + ["--pretrained-checkpoint", "dense"], ["--pretrained-checkpoint"]),
    (UP + ["--lora-rank", "4"], ["--lora-rank"]),
    (UP + ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"], ["sinkhorn"]),
    (UP + ["--moe-router-score-function", "sigmoid", "--moe-router-topk", "1"], ["sigmoid", "--moe-router-topk > 1"]),
    (UP + ["--num-experts", "8", "--moe-router-topk", "4", "--moe-upcycling-granularity", "4",
           "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"], ["--moe-router-num-groups 4"]),
])
def test_refused_upcycling_flags(capsys, extra, words):
    parse_refused(capsys, BASE + extra, *words)


def test_converters_flags_of_an_upcycled_checkpoint_leave_upcycling_out():
    """An upcycled run's checkpoint records --moe-use-upcycling (how the run began); the converter's
    printed flags to load it are the model's, without it."""
    from megatron_lite.checkpoint.convert import pretrain_flags

    flat = {"num_experts": 4, "moe_use_upcycling": True, "moe_upcycling_granularity": 2, "moe_ffn_hidden_size": 64}
    flags = pretrain_flags(flat, release=True)
    assert "--num-experts" in flags and not any("upcycling" in f for f in flags)
