"""Schedule op orders, the equal-cost simulator and bubble fractions, and the in-process schedule.

Cost model: a forward is 1 time unit and a backward 2 units (t_b = 2 t_f, the usual estimate) on
every (virtual) stage; the results are also checked at 1:1. Communication is free. Under this
model the bubble fraction — idle time over busy time, summed over ranks (Narayanan et al.'s
bubble time / ideal time) — is exactly (p-1)/m for 1F1B and (p-1)/(v*m) for interleaved 1F1B,
whatever the ratio of t_b to t_f, which is what the formulas promise; the tests assert exact
equality (1e-12).
"""

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_lite.parallel.pipeline import get_forward_backward_func
from megatron_lite.parallel.pipeline.order import (
    order_1f1b,
    order_interleaved,
    order_no_pipelining,
    rank_order,
    warmup_interleaved,
)
from megatron_lite.parallel.pipeline.p2p import PipeComm, release_output
from megatron_lite.parallel.pipeline.schedules import (
    backward_from,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)
from megatron_lite.parallel.pipeline.trace import (
    Event,
    Trace,
    bubble_fraction,
    measured_bubble_fraction,
    peak_in_flight,
    render_grid,
    simulate,
    simulated_orders,
)
from megatron_lite.parallel.state import ParallelState

COSTS = [(1.0, 2.0), (1.0, 1.0)]
CASES_1F1B = [(2, 1), (2, 4), (4, 3), (4, 4), (4, 8), (8, 16), (3, 7)]
CASES_INTERLEAVED = [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (2, 6, 4), (8, 16, 2)]


def _check_order_properties(orders, p, m, v):
    """Each rank runs every (micro-batch, chunk) forward and backward once, forward first."""
    for ops in orders.values():
        assert sorted(ops) == sorted((k, mb, c) for k in "FB" for mb in range(m) for c in range(v))
        for mb in range(m):
            for c in range(v):
                assert ops.index(("F", mb, c)) < ops.index(("B", mb, c))


def _check_stage_order(timeline, p, v):
    """On the simulated timeline, forwards go up the virtual stages and backwards come down."""
    end = {(op[0], op[1], op[2] * p + r): e for r, ops in timeline.items() for op, _, e in ops}
    start = {(op[0], op[1], op[2] * p + r): s for r, ops in timeline.items() for op, s, _ in ops}
    for (kind, mb, s), t0 in start.items():
        if kind == "F" and s > 0:
            assert end[("F", mb, s - 1)] <= t0
        if kind == "B":
            assert end[("F", mb, s)] <= t0
            if s < p * v - 1:
                assert end[("B", mb, s + 1)] <= t0


@pytest.mark.parametrize("p, m", CASES_1F1B)
@pytest.mark.parametrize("f_cost, b_cost", COSTS)
def test_1f1b_bubble_and_memory_bound(p, m, f_cost, b_cost):
    orders = simulated_orders(p, m)
    _check_order_properties(orders, p, m, 1)
    timeline = simulate(orders, p, 1, f_cost, b_cost)
    _check_stage_order(timeline, p, 1)
    assert bubble_fraction(timeline) == pytest.approx((p - 1) / m, abs=1e-12)
    span = max(e for ops in timeline.values() for _, _, e in ops)
    assert span == pytest.approx((m + p - 1) * (f_cost + b_cost))
    for r, ops in orders.items():
        # in-flight activations: never more than p - r, and that bound is reached (not m)
        assert peak_in_flight(ops) == min(p - r, m)


@pytest.mark.parametrize("p, m, v", CASES_INTERLEAVED)
@pytest.mark.parametrize("f_cost, b_cost", COSTS)
def test_interleaved_bubble(p, m, v, f_cost, b_cost):
    orders = simulated_orders(p, m, v)
    _check_order_properties(orders, p, m, v)
    timeline = simulate(orders, p, v, f_cost / v, b_cost / v)  # a chunk holds 1/v of the stage
    _check_stage_order(timeline, p, v)
    assert bubble_fraction(timeline) == pytest.approx((p - 1) / (v * m), abs=1e-12)
    for r, ops in orders.items():
        assert peak_in_flight(ops) == min(warmup_interleaved(p, r, m, v) + 1, m * v)


def test_simulator_detects_a_deadlocking_order():
    # rank 1 wants micro-batch 1 before 0, but rank 0 only sends 1 after 0's backward came back
    bad = {0: [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)], 1: [("F", 1, 0), ("F", 0, 0), ("B", 0, 0), ("B", 1, 0)]}
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad, 2)
    with pytest.raises(ValueError, match="deadlocks"):
        simulate({0: [("B", 0, 0), ("F", 0, 0)]}, 1)


def test_op_orders_by_hand():
    assert order_1f1b(4, 0, 5) == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("B", 0, 0), ("F", 4, 0),
                                   ("B", 1, 0), ("B", 2, 0), ("B", 3, 0), ("B", 4, 0)]
    assert order_1f1b(4, 3, 2) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    assert order_no_pipelining(2) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    # p=2, v=2, m=4: groups of 2 micro-batches through chunk 0 then chunk 1; backwards chunk 1 first
    assert order_interleaved(2, 1, 4, 2)[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1),
                                                 ("F", 1, 1), ("B", 1, 1)]
    assert rank_order(2, 0, 4, 2) == order_interleaved(2, 0, 4, 2)


def test_grid_and_bubble_by_hand():
    timeline = simulate(simulated_orders(2, 2), 2)
    assert render_grid(timeline) == "rank 0: F0  F1  .   B0  .   B1\nrank 1: .   F0  B0  F1  B1  ."
    assert bubble_fraction(timeline) == 0.5  # 4 idle slots over 8 busy
    grid = render_grid(simulate(simulated_orders(2, 2, 2), 2, 2))
    assert grid.splitlines()[0].startswith("rank 0: F0a F1a F0b F1b")


def test_measured_bubble_from_times():
    trace = Trace([Event(0, 0, "F", 0, 0), Event(0, 1, "B", 0, 0), Event(1, 0, "F", 0, 0), Event(1, 1, "B", 0, 0)])
    trace.times = [(0.0, 1.0), (4.0, 6.0), (1.0, 2.0), (2.0, 4.0)]
    # rank 0: span 6, busy 3; rank 1: span 3, busy 3 -> idle 3 over busy 6
    assert measured_bubble_fraction(trace) == pytest.approx(0.5)
    assert measured_bubble_fraction(trace, {0: (0.0, 6.0), 1: (0.0, 6.0)}) == pytest.approx(6 / 6)


def _stub_state(p, vpp=None):
    return SimpleNamespace(pp_size=p, pp_rank=0, tp_size=1, vpp_size=vpp)


def test_choice_of_schedule():
    assert get_forward_backward_func(_stub_state(1)) is forward_backward_no_pipelining
    assert get_forward_backward_func(_stub_state(2)) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(_stub_state(2, 1)) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(_stub_state(2, 2)) is forward_backward_pipelining_with_interleaving


def _call(fn, state, m, model, data=None):
    return fn(forward_step_func=None, data_iterator=data, model=model, num_microbatches=m,
              comm=PipeComm(state, (4, 1, 8), torch.float32))


@pytest.mark.parametrize("m", [6, 3, 0])
def test_interleaved_rejects_microbatch_counts_not_a_multiple_of_p(m):
    with pytest.raises(ValueError) as err:
        _call(forward_backward_pipelining_with_interleaving, _stub_state(4, 2), m, [nn.Identity()] * 2, [None] * 2)
    text = str(err.value)
    assert f"= {m} " in text and "--pipeline-model-parallel-size 4" in text
    assert "--global-batch-size" in text and "--micro-batch-size" in text


def test_schedule_misuse_is_a_clear_error():
    with pytest.raises(ValueError, match="one model chunk per rank.*vpp"):
        _call(forward_backward_pipelining_without_interleaving, _stub_state(2), 2, [nn.Identity()] * 2)
    with pytest.raises(ValueError, match="one iterator per model chunk"):
        _call(forward_backward_pipelining_with_interleaving, _stub_state(2, 2), 2, [nn.Identity()] * 2, iter([]))


def test_release_output_keeps_the_graph():
    w = torch.randn(5, 5, requires_grad=True)
    x = torch.randn(3, 5, requires_grad=True)
    g = torch.randn(3, 5)
    torch.tanh(x @ w).backward(g)
    expected_w, expected_x = w.grad.clone(), x.grad.clone()
    w.grad = x.grad = None
    y = torch.tanh(x @ w)
    release_output(y)
    assert y.numel() == 1  # the values are gone ...
    backward_from(y, g)  # ... but backward still works from the recorded graph
    torch.testing.assert_close(w.grad, expected_w, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, expected_x, rtol=0, atol=0)
    view = torch.tanh(x @ w).t()
    release_output(view)
    assert view.shape == (5, 3)  # views are left alone


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batches(m):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)) for _ in range(m)]


def _step(data_iterator, model):
    x, y = next(data_iterator)
    out = model(x)

    def loss_func(o):
        loss = ((o - y) ** 2).mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


@pytest.mark.parametrize("forward_only", [False, True])
def test_no_pipelining_accumulates_like_one_big_batch(forward_only):
    """Gradients = those of the mean loss over m micro-batches (times the grad scale); sync back on
    only for the last backward; reported losses per micro-batch."""
    m, model, ref = 3, _Toy(), _Toy()
    ref_losses = []
    for x, y in _batches(m):
        loss = ((ref(x) - y) ** 2).mean()
        (loss * 4.0 / m).backward()
        ref_losses.append(loss.item())
    trace, exits = [], []

    class NoSync:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            exits.append(len(trace))

    reported = forward_backward_no_pipelining(
        forward_step_func=_step, data_iterator=iter(_batches(m)), model=[model], num_microbatches=m,
        comm=PipeComm(ParallelState(), (4, 2, 8), torch.float32), forward_only=forward_only,
        grad_scale_func=lambda loss: loss * 4.0, no_sync_func=NoSync, trace=trace,
    )
    torch.testing.assert_close(torch.tensor([r["loss"].item() for r in reported]), torch.tensor(ref_losses))
    kinds = [(e.kind, e.microbatch) for e in trace]
    if forward_only:
        assert kinds == [("F", i) for i in range(m)]
        assert all(p.grad is None for p in model.parameters())
        return
    assert kinds == [(k, mb) for k, mb, _ in order_no_pipelining(m)]
    assert exits == [2 * m - 1]  # reduction allowed again right before the last backward
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_plot_schedule_writes_a_png(tmp_path, capsys):
    from tests.tools import load_tool

    tool = load_tool("plot_schedule")
    out = tmp_path / "s.png"
    assert tool.main(["-p", "2", "-m", "4", "-v", "2", "--compare", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "bubble 0.2500 (formula 0.2500)" in text and "bubble 0.1250 (formula 0.1250)" in text
    with pytest.raises(SystemExit) as err:
        tool.main(["-p", "4", "-m", "6", "-v", "2", "--out", str(out)])
    assert err.value.code == 2
    line = capsys.readouterr().err.strip()  # the tool's own flags, not pretrain_gpt.py's --global-batch-size
    assert "-m) 6" in line and "-p) 4" in line and "--global-batch-size" not in line, line


def test_plot_schedule_creates_the_output_folder(tmp_path, capsys):
    """--out in a folder that does not exist yet (as tools/plot_loss.py): it was a FileNotFoundError traceback."""
    from tests.tools import load_tool

    out = tmp_path / "figures" / "new" / "s.png"
    assert load_tool("plot_schedule").main(["-p", "2", "-m", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(out.parent) == ["s.png"]


def test_plot_schedule_caps_the_image_size(tmp_path, monkeypatch, capsys):
    """The figure grew 0.45 inch per micro-batch and stage: -p 32 -m 64 drew a ~270-megapixel PNG that PIL
    refuses to open. It is capped at MAX_INCHES (made small here so a small schedule reaches the cap)."""
    from PIL import Image

    from tests.tools import load_tool

    tool = load_tool("plot_schedule")
    monkeypatch.setattr(tool, "MAX_INCHES", (10, 3))
    out = tmp_path / "s.png"
    assert tool.main(["-p", "4", "-m", "8", "-v", "2", "--compare", "--out", str(out)]) == 0
    assert Image.open(out).size == (1200, 360)  # dpi 120


@pytest.mark.parametrize("name, magic", [("s.svg", b"<?xml"), ("s.pdf", b"%PDF"), ("s.png", b"\x89PNG"),
                                         ("s.img", b"\x89PNG")])  # no format of that name: PNG
def test_the_image_format_follows_the_extension(tmp_path, capsys, name, magic):
    """plot_schedule.py / plot_loss.py / plan.py --png x.svg wrote PNG bytes under the .svg name."""
    from tests.tools import load_tool

    out = tmp_path / name
    assert load_tool("plot_schedule").main(["-p", "2", "-m", "2", "--out", str(out)]) == 0
    assert out.read_bytes().startswith(magic) and os.listdir(tmp_path) == [name]
