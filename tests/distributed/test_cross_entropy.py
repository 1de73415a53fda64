"""vocab_parallel_cross_entropy against F.cross_entropy on the full, unpadded logits.

Loss and logit gradients must match within rtol 1e-5 (fp32). The padded tail of the vocabulary
is filled with large values to prove it never reaches the loss, and its gradient must be zero.
With ``in_place`` (the language model's call) the padded entries are overwritten with -inf in the
caller's logits and the results are the same, in fp32 and bf16; without it the logits are left intact.
A bf16 gradient is the fp32 gradient of the same logits rounded once, at every TP size.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import padded_vocab_size
from tests.harness import cached_state, run_ranks

S, B = 6, 3


def check_cross_entropy(tp, vocab, smoothing, count_collectives=False, dtype=torch.float32):
    state = cached_state(tp=tp) if tp > 1 else ParallelState()
    padded = padded_vocab_size(vocab, 4, tp)
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(S, B, padded, generator=gen) * 3).to(dtype)
    logits[..., vocab:] = 50.0  # padding: would dominate the softmax if it were not excluded
    target = torch.randint(0, vocab, (S, B), generator=gen)
    dloss = torch.rand(S, B, generator=gen)

    ref_logits = logits[..., :vocab].float().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none", label_smoothing=smoothing)
    ref.backward(dloss.reshape(-1))

    part = logits.chunk(tp, dim=-1)[state.tp_rank].clone().requires_grad_()
    calls = []
    original = dist.all_reduce
    if count_collectives:
        dist.all_reduce = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    try:
        loss = vocab_parallel_cross_entropy(part, target, state.tp_group, label_smoothing=smoothing, vocab_size=vocab)
    finally:
        dist.all_reduce = original
    loss.backward(dloss)
    torch.testing.assert_close(loss.reshape(-1), ref.detach(), rtol=1e-5, atol=1e-6)
    full_grad = torch.cat([ref_logits.grad, torch.zeros(S, B, padded - vocab)], dim=-1)
    assert part.grad.dtype == dtype
    torch.testing.assert_close(part.grad.float(), full_grad.chunk(tp, dim=-1)[state.tp_rank],
                               rtol=1e-5 if dtype == torch.float32 else 2**-8, atol=1e-6)
    return len(calls)


def check_both_dtypes(tp, vocab, smoothing, count_collectives=False):
    """fp32 and bf16 logits (the loss in fp32 either way): the collectives counted in each."""
    return [check_cross_entropy(tp, vocab, smoothing, count_collectives, dtype)
            for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("vocab", [32, 37])  # 37: not divisible by TP, padded to a multiple of 4 x TP
def test_single_process(vocab, smoothing):
    check_both_dtypes(1, vocab, smoothing)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel(tp):
    for vocab in (32, 37, 5):  # 5 with TP 4 -> 16 padded: whole shards are padding
        for smoothing in (0.0, 0.1):
            run_ranks(tp, check_both_dtypes, tp, vocab, smoothing)


def test_one_max_and_one_fused_sum():
    # The max and the stacked sums: exactly two all-reduces per call, with or without smoothing, fp32 or bf16.
    assert run_ranks(2, check_both_dtypes, 2, 37, 0.1, True) == [[2, 2], [2, 2]]
    assert run_ranks(2, check_both_dtypes, 2, 37, 0.0, True) == [[2, 2], [2, 2]]


def test_non_contiguous_target():
    logits = torch.randn(3, 5, 11).transpose(0, 1).requires_grad_()  # [5, 3, 11], non-contiguous
    target = torch.randint(0, 11, (3, 5)).t()
    loss = vocab_parallel_cross_entropy(logits, target)
    loss.sum().backward()
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 11), target.reshape(-1), reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(loss.reshape(-1), ref)
    torch.testing.assert_close(logits.grad, ref_logits.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_entries_in_place_or_in_a_copy(dtype):
    vocab, padded = 37, 40
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(S, B, padded, generator=gen) * 3).to(dtype)
    logits[..., vocab:] = 50.0
    target = torch.randint(0, vocab, (S, B), generator=gen)
    dloss = torch.rand(S, B, generator=gen) + 0.5  # a gradient that differs per token
    results = {}
    for in_place in (False, True):
        leaf = logits.clone().requires_grad_()
        fresh = leaf * 1  # a non-leaf of its own, as the output layer's logits are
        before = fresh.detach().clone()
        loss = vocab_parallel_cross_entropy(fresh, target, vocab_size=vocab, in_place=in_place)
        loss.backward(dloss)
        results[in_place] = (loss.detach(), leaf.grad)
        assert torch.equal(fresh.detach()[..., :vocab], before[..., :vocab])
        padding = fresh.detach()[..., vocab:]
        assert torch.isneginf(padding).all() if in_place else torch.equal(padding, before[..., vocab:])
    assert torch.equal(results[False][0], results[True][0]) and torch.equal(results[False][1], results[True][1])
    assert not results[True][1][..., vocab:].any()
    ref_logits = logits[..., :vocab].float().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none")
    ref.backward(dloss.reshape(-1))
    torch.testing.assert_close(results[True][0].reshape(-1), ref.detach(), rtol=1e-5, atol=1e-5)
    # the logits' gradient, in their dtype: the fp32 gradient rounded once (bf16: within one rounding)
    torch.testing.assert_close(results[True][1][..., :vocab].float(), ref_logits.grad,
                               rtol=1e-5 if dtype == torch.float32 else 2**-8, atol=1e-6)


@pytest.mark.parametrize("padded", [40, 37])
@pytest.mark.parametrize("in_place", [False, True])
def test_cpu_softmax_of_16_bit_logits_overwrites_its_own_fp32_copy(padded, in_place):
    """On a CPU, 16-bit logits (padded or not, in place or not) make one logits-sized fp32 buffer in the
    forward: their fp32 copy, which the softmax then overwrites (two: the copy and a fresh softmax)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = 37
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(S, B, padded, generator=gen) * 3).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (S, B), generator=gen)
    storages = set()

    class Buffers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() == logits.numel():
                storages.add(out.untyped_storage().data_ptr())
            return out

    fresh = logits * 1
    with Buffers():
        loss = vocab_parallel_cross_entropy(fresh, target, vocab_size=vocab, in_place=in_place)
    assert len(storages) == 1
    loss.backward(torch.ones(S, B))
    ref_logits = logits.detach()[..., :vocab].float().requires_grad_()
    F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none").sum().backward()
    torch.testing.assert_close(logits.grad[..., :vocab].float(), ref_logits.grad, rtol=2**-8, atol=1e-6)
