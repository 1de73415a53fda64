"""ZB-H1 op orders, the simulator's bubble against the formula, the memory bound, and the B/W split.

Equal-cost model of the zero-bubble paper: F, B (input gradient) and W (weight gradients) cost
T_F, T_B, T_W per stage; 1F1B runs B and W as one backward of T_B + T_W. For m >= p the
simulated ZB-H1 bubble (idle over busy time summed over ranks) is exactly
(p-1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W)), i.e. (p-1)/(3m) at equal costs, a third of
1F1B's (p-1)/m; asserted to 1e-12.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_lite.parallel.pipeline import get_forward_backward_func
from megatron_lite.parallel.pipeline.order import order_1f1b, order_zb_h1, rank_order
from megatron_lite.parallel.pipeline.schedules import (
    forward_backward_pipelining_zero_bubble,
    forward_backward_pipelining_zero_bubble_interleaved,
)
from megatron_lite.parallel.pipeline.trace import (
    bubble_fraction,
    peak_in_flight,
    render_grid,
    simulate,
    simulated_orders,
)
from megatron_lite.parallel.pipeline.wgrad import WeightGradStore
from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear

CASES = [(2, 2), (2, 4), (4, 4), (4, 8), (3, 7), (8, 16), (4, 13)]
COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.5, 1.0)]


@pytest.mark.parametrize("p, m", CASES)
def test_zb_h1_orders_keep_1f1b_skeleton_and_run_every_w_after_its_b(p, m):
    for r in range(p):
        ops = order_zb_h1(p, r, m)
        assert [op for op in ops if op[0] != "W"] == order_1f1b(p, r, m)  # same F/B order, same transfers
        assert sorted(op for op in ops if op[0] == "W") == [("W", i, 0) for i in range(m)]
        for i in range(m):
            assert ops.index(("B", i, 0)) < ops.index(("W", i, 0))
        assert [op[1] for op in ops if op[0] == "W"] == list(range(m))  # W passes in micro-batch order


@pytest.mark.parametrize("p, m", CASES)
@pytest.mark.parametrize("f, b, w", COSTS)
def test_zb_h1_bubble_equals_formula(p, m, f, b, w):
    zb = simulate(simulated_orders(p, m, 1, "zb-h1"), p, 1, f, b, w)
    assert bubble_fraction(zb) == pytest.approx((p - 1) * (f + b - w) / (m * (f + b + w)), abs=1e-12)
    one = simulate(simulated_orders(p, m), p, 1, f, b + w)
    assert bubble_fraction(one) == pytest.approx((p - 1) / m, abs=1e-12)
    if (f, b, w) == (1.0, 1.0, 1.0):
        assert bubble_fraction(zb) == pytest.approx((p - 1) / (3 * m), abs=1e-12)


@pytest.mark.parametrize("p, m", CASES + [(4, 2), (8, 3)])
def test_zb_h1_in_flight_never_above_1f1b_bound(p, m):
    bound = max(peak_in_flight(order_1f1b(p, r, m)) for r in range(p))  # p (or m): 1F1B's first rank
    assert bound == min(p, m)
    for r in range(p):
        assert peak_in_flight(order_zb_h1(p, r, m)) <= bound


def test_zb_h1_grid_by_hand():
    grid = render_grid(simulate(simulated_orders(2, 3, 1, "zb-h1"), 2, 1, 1, 1, 1))
    assert grid == ("rank 0: F0  F1  .   B0  W0  F2  B1  W1  B2  W2\n"
                    "rank 1: .   F0  B0  F1  B1  W0  F2  B2  W1  W2")


def _state(p, vpp=None):
    return SimpleNamespace(pp_size=p, pp_rank=0, tp_size=1, vpp_size=vpp)


def test_schedule_choice_and_refusals():
    assert get_forward_backward_func(_state(2), "zb-h1") is forward_backward_pipelining_zero_bubble
    assert get_forward_backward_func(_state(2, 2), "zb-h1") is forward_backward_pipelining_zero_bubble_interleaved
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        get_forward_backward_func(_state(2), "gpipe")
    with pytest.raises(ValueError, match="multiple of --pipeline-model-parallel-size 2"):
        rank_order(2, 0, 3, 2, "zb-h1")


def _layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(ColumnParallelLinear(8, 16), torch.nn.Tanh(), RowParallelLinear(16, 8),
                               torch.nn.LayerNorm(8))


def test_store_defers_exactly_the_parallel_linear_weight_grads():
    """B leaves the GEMM weights' (and the column bias') gradients to W; norms and the row bias
    (added after the reduction) get theirs in B. After W every gradient equals plain autograd's,
    and each parameter's post-accumulate hook (what DDP uses) saw a gradient once per micro-batch,
    the GEMM weights' in W. (Autograd also calls the hook of a deferred weight in B, with no
    gradient; DDP's hook ignores such calls.)"""
    ref, model = _layers(), _layers()
    xs = [torch.randn(5, 2, 8) for _ in range(2)]
    for x in xs:
        ref(x).pow(2).sum().backward()
    fired = []

    def hook(name):
        def record(param):
            if param.grad is not None:
                fired.append(name)
        return record

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(hook(name))
    store = WeightGradStore()
    with store.installed(model):
        for x in xs:
            with store.collect():
                model(x).pow(2).sum().backward()
        assert sorted(fired) == sorted(["2.bias", "3.bias", "3.weight"] * 2)
        assert model[0].weight.grad is None and model[2].weight.grad is None
        fired.clear()
        store.flush()
        store.flush()
        assert sorted(fired) == sorted(["0.weight", "0.bias", "2.weight"] * 2)
    assert model[0].gemm is not store.gemm  # restored
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_store_outside_collect_computes_weight_grads_at_once_and_checks_leftovers():
    model = _layers()
    store = WeightGradStore()
    with store.installed(model):
        model(torch.randn(3, 8)).sum().backward()  # not collecting: nothing deferred
    assert model[0].weight.grad is not None and store.num_pending == 0
    with pytest.raises(RuntimeError, match="never ran"):
        with store.installed(model):
            with store.collect():
                model(torch.randn(3, 8)).sum().backward()


def test_plot_schedule_draws_zb_h1_with_w_ops(tmp_path, capsys):
    from tests.tools import load_tool

    tool = load_tool("plot_schedule")
    out = tmp_path / "zb.png"
    assert tool.main(["-p", "4", "-m", "8", "--schedule", "zb-h1", "--compare", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "1F1B: p=4, m=8; bubble 0.3750 (formula 0.3750)" in text
    assert "ZB-H1: p=4, m=8; bubble 0.1250 (formula 0.1250)" in text
    assert "B7  W7" in text
    # with -v: interleaved zero bubble beside interleaved 1F1B
    assert tool.main(["-p", "2", "-m", "4", "-v", "2", "--schedule", "zb-h1", "--compare", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "interleaved 1F1B (v=2): p=2, m=4; bubble 0.1250 (formula 0.1250)" in text
    assert "zero bubble interleaved (v=2): p=2, m=4; bubble 0.0417 (formula 0.0417)" in text
    assert "B3a W3b W2a W3a" in text
