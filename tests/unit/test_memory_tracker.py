"""The live-tensor tracker (``MemoryTracker``) counts known sizes in the right category.

Each test makes tensors whose bytes are known in advance (fp32: 4 bytes per element) and checks
the tracker's live bytes per category exactly, while they live and after they are freed: an
activation saved for backward, temporaries (and the peak they leave), views and resized storages,
the model state of a module and a torch optimizer, and the report ``--memory-report`` prints.
"""

import pytest
import torch

from megatron_lite.perf.memory_tracker import CATEGORIES, MemoryReport, MemoryTracker

CPU = torch.device("cpu")


def _live(tracker):
    return tracker.live()[CPU].bytes


class _SavesBuffer(torch.autograd.Function):
    """y = x * 2, saving a fresh [1000] fp32 buffer for backward: an activation of 4000 bytes."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.ones(1000))
        return x * 2

    @staticmethod
    def backward(ctx, dy):
        (buf,) = ctx.saved_tensors
        return dy * buf[0]


def test_an_activation_of_known_size_is_counted_until_backward():
    x = torch.randn(10, requires_grad=True)
    tracker = MemoryTracker()
    with tracker:
        y = _SavesBuffer.apply(x)
        live = _live(tracker)
        assert live["activations"] == 4000 and live["temporaries"] == 40  # the buffer; y
        y.sum().backward()
        del y
        live = _live(tracker)
    assert live["activations"] == 0 and live["temporaries"] == 40  # the graph and what it saved are gone; x.grad
    assert tracker.peak[CPU].bytes["activations"] == 4000


def test_temporaries_leave_a_peak_and_views_count_once():
    tracker = MemoryTracker()
    with tracker:
        a = torch.ones(1000)
        b = a * 2
        views = [b[1:], b.view(10, 100), b[::2]]
        assert _live(tracker)["temporaries"] == 8000  # a and b; the views share b's storage
        del a, b, views
        assert _live(tracker)["temporaries"] == 0
    assert tracker.peak[CPU].bytes["temporaries"] == 8000
    assert "aten.mul.Tensor in forward" in tracker.peak[CPU].where


def test_resized_storages_are_followed():
    """ZeRO-3 frees a gathered unit by resizing its storage to 0 bytes and regathers into it."""
    tracker = MemoryTracker()
    with tracker:
        t = torch.zeros(500)
        t.untyped_storage().resize_(0)
        assert _live(tracker)["temporaries"] == 0
        t.untyped_storage().resize_(2000)
        assert _live(tracker)["temporaries"] == 2000
    assert tracker.peak[CPU].total == 2000


def test_model_state_of_a_module_and_a_torch_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemoryTracker([model], opt)
    with tracker:
        assert _live(tracker)["parameters"] == 4 * n
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
        live = _live(tracker)
    counters = 4 * len(opt.state)  # one fp32 step count per parameter tensor
    assert (live["parameters"], live["gradients"], live["optimizer state"]) == (4 * n, 4 * n, 8 * n + counters)
    assert live["activations"] == live["communication"] == 0


class _Wrapper:
    """A Megatron-style optimizer: work around its torch optimizer's step (an all-gather buffer after it)."""

    def __init__(self, inner):
        self.optimizer = inner

    def step(self):
        self.optimizer.step()
        torch.zeros(10_000)  # 40000 bytes, the step's peak


def test_a_wrapper_optimizers_whole_step_is_the_optimizer_step():
    model = torch.nn.Linear(4, 4)
    opt = _Wrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    tracker = MemoryTracker([model], opt)
    with tracker:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        torch.ones(10).sum()
        assert tracker._phase() == "after the optimizer step"
    assert tracker.peak[CPU].where == "aten.zeros.default in the optimizer step"
    assert "step" not in vars(opt)  # unwrapped on exit


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_peak_after_the_optimizer_step_is_not_called_forward(wrapped):
    """The first step's peak comes once Adam's moments exist: at the step's last operators (the loss
    averaging after the optimizer step). It was reported 'at aten.stack.default in forward'."""
    model = torch.nn.Linear(64, 64)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    opt = _Wrapper(adam) if wrapped else adam
    tracker = MemoryTracker([model], opt)
    with tracker:
        assert tracker._phase() == "in forward"
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        torch.stack([torch.ones(20_000), torch.ones(20_000)])  # after the step: 320 kB more than the moments
    assert tracker.peak[CPU].where == "aten.stack.default after the optimizer step", tracker.peak[CPU].where


def test_register_labels_and_refuses_unknown_categories():
    tracker = MemoryTracker()
    kept = torch.zeros(250)
    tracker.register([kept], "communication")
    with tracker:
        torch.ones(3).sum()  # made and dropped
        copy = kept * 1
        assert _live(tracker)["communication"] == 1000 and _live(tracker)["temporaries"] == 1000
        del copy
    with pytest.raises(ValueError, match="unknown memory category 'weights'"):
        tracker.register([kept], "weights")


def test_report_covers_the_first_steps_only():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = MemoryReport([model], opt, steps=1)
    lines = []
    for iteration in (1, 2):
        with report.tracking():
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        lines.append(report.after_step(iteration))
    assert len(lines[0]) == 1 and lines[1] == [] and len(report.steps_seen) == 1
    line = lines[0][0]
    assert line.startswith("memory report (rank 0, iteration 1, live tensor bytes) cpu: peak ")
    assert all(name in line for name in CATEGORIES) and "; after the step " in line
    after = report.steps_seen[0]["after"][CPU].bytes
    assert after["parameters"] == after["gradients"] == 4 * 72
