"""The communication counter: ring volumes, per-step bookkeeping, and nothing recorded when off."""

from fractions import Fraction

import pytest

from megatron_lite.perf.comm_volume import CommVolume, record, ring_bytes


def test_ring_volumes():
    assert ring_bytes("all_reduce", 1000, 4) == Fraction(1500)
    assert ring_bytes("all_gather", 1000, 4) == ring_bytes("reduce_scatter", 1000, 4) == Fraction(750)
    assert ring_bytes("all_reduce", 10, 3) == Fraction(40, 3)  # kept exact
    assert ring_bytes("send", 64, 2) == 64
    with pytest.raises(ValueError, match="unknown communication op"):
        ring_bytes("broadcast", 1, 2)


def test_counts_only_while_active_and_per_step():
    volume = CommVolume()
    record("tp", "all_reduce", 100, 2)  # no counter active: dropped
    with volume.counting():
        record("tp", "all_reduce", 100, 2)
        record("pp", "send", 8, 2)
        record("pp", "send", 8, 2)
    record("dp", "all_reduce", 100, 2)  # after the block: dropped
    step = volume.end_step()
    assert step == {("tp", "all_reduce"): 100, ("pp", "send"): 16}
    assert CommVolume.per_kind(step) == {"tp": 100, "sp": 0, "cp": 0, "ep": 0, "dp": 0, "pp": 16}
    assert CommVolume.format(step) == "comm MB sent: tp 0.000 | pp 0.000"
    assert volume.end_step() == {} and len(volume.steps) == 2
    with volume.counting(), pytest.raises(ValueError, match="unknown group kind"):
        record("xx", "send", 1, 2)


def test_counts_what_another_thread_sends_as_autograd_device_threads_do():
    """A CUDA backward pass runs autograd.Function.backward and the gradient hooks on the engine's device
    thread, whose Python context is not the training loop's (so a ContextVar set there reads unset): the
    TP backward all-reduces and gradient reduce-scatters of a GPU step were not counted. Such a thread's
    records go to the counter the process holds open."""
    import threading

    import torch

    class AllReduceInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            record("tp", "all_reduce", grad.numel() * grad.element_size(), 2)
            return grad

    def backward_elsewhere():
        x = torch.ones(4, requires_grad=True)
        AllReduceInBackward.apply(x).sum().backward()

    volume = CommVolume()
    with volume.counting():
        worker = threading.Thread(target=backward_elsewhere)
        worker.start()
        worker.join()
    worker = threading.Thread(target=backward_elsewhere)  # no counter open: dropped
    worker.start()
    worker.join()
    assert volume.end_step() == {("tp", "all_reduce"): 16}
