"""fusions.dropout.dropout on the CPU: F.dropout's function (kept entries scaled by 1 / (1 - p), the
rest zero, about p dropped, gradient through the same mask), a boolean mask (1 byte per element
saved for backward), identity when not training or p = 0, zeros at p = 1, and reproducible from the
generator state. drop_mask (the CPU's draw: two 32-bit lanes per 64-bit random word) drops each
entry with probability p, in both lanes, with no correlation between neighbours."""

import pytest
import torch

from megatron_lite.fusions.dropout import drop_mask, dropout
from megatron_lite.perf.activation_memory import saved_activation_bytes


def test_scales_what_it_keeps_and_drops_about_p():
    x = torch.rand(256, 1024) + 0.5  # no zeros of its own
    torch.manual_seed(0)
    y = dropout(x, 0.2)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.8)
    assert abs(kept.float().mean().item() - 0.8) < 3e-3  # 262144 draws: the standard error is 8e-4


def test_gradient_uses_the_same_mask():
    x = torch.randn(64, 32, requires_grad=True)
    torch.manual_seed(1)
    y = dropout(x, 0.3)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, (y != 0).float() / 0.7)


def test_saves_one_byte_per_element():
    layer = torch.nn.Identity()
    layer.forward = lambda x: dropout(x, 0.1)
    x = torch.randn(128, 64, dtype=torch.bfloat16, requires_grad=True)
    assert saved_activation_bytes(layer, x) == 128 * 64  # the boolean keep mask only


def test_identity_zeros_and_reproducibility():
    x = torch.randn(8, 8)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    torch.manual_seed(3)
    a = dropout(x, 0.5)
    torch.manual_seed(3)
    assert torch.equal(a, dropout(x, 0.5))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_mask_drops_p_in_both_lanes_independently(p):
    torch.manual_seed(7)
    keep = (~drop_mask((1000, 1001), p)).float()  # an odd count: the last word's second lane unused
    assert keep.shape == (1000, 1001)
    flat = keep.flatten()
    se = (p * (1 - p) / (flat.numel() / 2)) ** 0.5  # standard error of a rate over one lane's draws
    for lane in (flat[0::2], flat[1::2]):  # each 64-bit word gives an even and an odd entry
        assert abs(lane.mean().item() - (1 - p)) < 5 * se
    a, b = flat[:-1] - flat.mean(), flat[1:] - flat.mean()
    assert abs((a * b).mean().item() / (a * a).mean().item()) < 0.01  # neighbours uncorrelated


def test_drop_mask_edges_and_reproducibility():
    assert not drop_mask((5, 3), 1e-12).any()  # p below 2^-33 rounds to keeping everything
    assert drop_mask((5, 3), 1 - 1e-12).all()  # and just below 1 to dropping everything
    torch.manual_seed(11)
    a = drop_mask((64, 33), 0.3)
    torch.manual_seed(11)
    assert torch.equal(a, drop_mask((64, 33), 0.3))
    assert not torch.equal(a, drop_mask((64, 33), 0.3))  # the generator moved on
