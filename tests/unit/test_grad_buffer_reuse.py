"""The data-parallel gradient buffer is not zero-filled between iterations: each parameter's first
gradient of an iteration is written over its ``main_grad``, later ones (micro-batches, a weight used
twice) are added, and a parameter that got no gradient is zeroed by ``finish_grad_sync``."""

import pytest
import torch
from torch import nn

from megatron_lite.parallel.data_parallel import DistributedDataParallel
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import ColumnParallelLinear


class _TwoLayers(nn.Module):
    """A parallel linear (with or without gradient-accumulation fusion) and a plain one used on request."""

    def __init__(self, fused: bool):
        super().__init__()
        self.lin = ColumnParallelLinear(12, 10, None, gradient_accumulation_fusion=fused)
        self.extra = nn.Linear(10, 10)

    def forward(self, x, use_extra: bool):
        y = self.lin(x)
        return self.extra(y) + y if use_extra else y


def _batch(seed):
    return torch.randn(4, 3, 12, generator=torch.Generator().manual_seed(seed))


def _reference_grads(model, batches, use_extra):
    """Plain autograd ``.grad`` sums of the same micro-batches on a copy of ``model``'s weights."""
    plain = _TwoLayers(False)
    plain.load_state_dict(model.state_dict())
    for x in batches:
        (plain(x, use_extra) ** 2).sum().backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in plain.named_parameters()}


@pytest.mark.parametrize("fused", [False, True])
def test_main_grad_is_this_iterations_gradient_without_a_zero_fill(fused):
    torch.manual_seed(0)
    model = _TwoLayers(fused)
    ddp = DistributedDataParallel(model, ParallelState())
    ddp.zero_grad_buffer()
    (ddp(_batch(1), True) ** 2).sum().backward()  # iteration 1 gives every param a gradient
    ddp.finish_grad_sync()
    assert model.extra.weight.main_grad.abs().sum() > 0

    ddp.zero_grad_buffer()  # iteration 2: two micro-batches, the extra layer unused
    with ddp.no_sync():
        (ddp(_batch(2), False) ** 2).sum().backward()
    (ddp(_batch(3), False) ** 2).sum().backward()
    want = _reference_grads(model, [_batch(2), _batch(3)], use_extra=False)
    for name in ("lin.weight", "lin.bias"):  # written over, then added: iteration 1 left no trace
        torch.testing.assert_close(dict(model.named_parameters())[name].main_grad, want[name], rtol=1e-6, atol=1e-6)
    ddp.finish_grad_sync()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.main_grad, want[name], rtol=1e-6, atol=1e-6, msg=name)
    assert torch.equal(model.extra.weight.main_grad, torch.zeros(10, 10))  # no gradient: zeroed


def test_zero_grad_buffer_does_not_fill_the_buffer():
    """The point of it: no pass over the whole buffer at the start of an iteration."""
    model = _TwoLayers(True)
    ddp = DistributedDataParallel(model, ParallelState())
    ddp.grad_buffer.fill_(7.0)
    ddp.zero_grad_buffer()
    assert torch.equal(ddp.grad_buffer, torch.full_like(ddp.grad_buffer, 7.0))
    (ddp(_batch(1), False) ** 2).sum().backward()
    ddp.finish_grad_sync()
    assert torch.equal(model.extra.bias.main_grad, torch.zeros(10))
    assert not torch.equal(model.lin.weight.main_grad, torch.full((10, 12), 7.0))
