"""Interleaved zero bubble (--pipeline-schedule zb-h1 with virtual stages): its op orders against the
simulator, its bubble against interleaved 1F1B's, its memory bound, and the planner that takes its
orders from it (the drawing tool: test_zero_bubble.py).

Equal-cost model: F, B (input gradient) and W (weight gradients) one unit each per chunk; interleaved
1F1B runs B and W as one backward of two units. Every rank's F/B order is interleaved 1F1B's (so its
sends and receives are too), every micro-batch-chunk gets exactly one W after its B, in B order (the
WeightGradStore flushes first in first out); the orders simulate without deadlock, their bubble is
a third of interleaved 1F1B's, (p-1)/(3vm), once m >= 2p (asserted to 1e-12) and below it at m = p,
and no rank ever holds more micro-batch-chunks in flight (F done, W not yet) than interleaved 1F1B's
first rank: (v+1)p - 1 when m > p, v*p when m = p.
"""

import pytest

from megatron_lite.parallel.pipeline.order import order_interleaved, rank_order, zb_interleaved_bound
from megatron_lite.parallel.pipeline.trace import (
    bubble_fraction,
    peak_in_flight,
    render_grid,
    simulate,
    simulated_orders,
)
from megatron_lite.perf.plan.estimate import in_flight_microbatches, pipeline_bubble

CASES = [(2, 2, 2), (2, 4, 2), (2, 8, 4), (3, 6, 2), (3, 9, 3), (4, 4, 2), (4, 8, 2), (4, 12, 3), (8, 16, 2),
         (8, 8, 4), (4, 32, 4)]


@pytest.mark.parametrize("p, m, v", CASES)
def test_orders_keep_the_interleaved_skeleton_and_run_each_w_once_after_its_b(p, m, v):
    for r in range(p):
        ops = rank_order(p, r, m, v, "zb-h1")
        assert [op for op in ops if op[0] != "W"] == order_interleaved(p, r, m, v)  # same F/B, same transfers
        bs = [(mb, c) for kind, mb, c in ops if kind == "B"]
        assert [(mb, c) for kind, mb, c in ops if kind == "W"] == bs  # each once, first in first out
        for mb, c in bs:
            assert ops.index(("B", mb, c)) < ops.index(("W", mb, c))


@pytest.mark.parametrize("p, m, v", CASES)
def test_no_deadlock_fewer_idle_slots_and_the_memory_bound(p, m, v):
    interleaved = simulate(simulated_orders(p, m, v), p, v, 1.0, 2.0)
    zb = simulate(simulated_orders(p, m, v, "zb-h1"), p, v, 1.0, 1.0, 1.0)  # raises on a deadlock
    span = max(end for ops in zb.values() for _, _, end in ops)
    idle = {name: sum(max(e for _, _, e in t[r]) - sum(e - s for _, s, e in t[r]) for r in t)
            for name, t in (("1f1b", interleaved), ("zb", zb))}
    assert idle["zb"] < idle["1f1b"]
    assert span < max(end for ops in interleaved.values() for _, _, end in ops)
    one_f_one_b = bubble_fraction(interleaved)
    assert one_f_one_b == pytest.approx((p - 1) / (v * m), abs=1e-12)
    assert bubble_fraction(zb) < one_f_one_b
    if m >= 2 * p:
        assert bubble_fraction(zb) == pytest.approx((p - 1) / (3 * v * m), abs=1e-12)
    assert pipeline_bubble(p, m, v, "zb-h1") == pytest.approx(bubble_fraction(zb), abs=1e-12)
    bound = max(peak_in_flight(order_interleaved(p, r, m, v)) for r in range(p))
    assert bound == zb_interleaved_bound(p, m, v) == (v * p if m == p else (v + 1) * p - 1)
    for r in range(p):  # every rank reaches it: the planner counts it on every stage
        assert peak_in_flight(rank_order(p, r, m, v, "zb-h1")) == bound
        assert in_flight_microbatches(p, r, m, v, "zb-h1") == bound / v


def test_grid_by_hand():
    """p=2, m=4, v=2: W passes fill the slots where interleaved 1F1B's rank 0 waits (slot 5, 17, 20)."""
    grid = render_grid(simulate(simulated_orders(2, 4, 2, "zb-h1"), 2, 2, 1, 1, 1))
    assert grid == (
        "rank 0: F0a F1a F0b F1b F2a B0b W0b F3a B1b W1b F2b B0a W0a F3b B1a B2b W1a W2b B3b B2a B3a W3b W2a W3a .\n"
        "rank 1: .   F0a F1a F0b B0b F1b B1b F2a B0a W0b F3a B1a W1b F2b B2b W0a F3b B3b B2a B3a W1a W2b W3b W2a W3a")

