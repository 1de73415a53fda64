"""DistributedDataParallel against a single-process reference on the concatenated global batch.

Every rank builds the same tiny MLP from a seeded generator and the same global batch; rank r
trains on its data-parallel slice in ``M`` micro-batches (all but the last inside ``no_sync``),
each micro-batch loss divided by ``M`` as the pipeline schedule does. After
``finalize_model_grads`` each ``main_grad`` must equal the gradient of the global-batch mean loss
of the unwrapped model (fp32: rtol 1e-5, atol 1e-7). The bf16 case checks the fp32 accumulation
exactly: ``main_grad`` equals the fp32 sum of the individual bf16 micro-batch gradients / dp
(rtol 1e-6), which a bf16 accumulator could not match.
"""

import pytest
import torch
from torch import nn

from megatron_lite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from tests.harness import cached_state, run_ranks

IN, HID, OUT, MICRO, M = 6, 8, 4, 3, 2  # 92 parameter elements in 4 tensors


def _model(dtype=torch.float32):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(IN, HID), nn.GELU(), nn.Linear(HID, OUT))
    return model.to(dtype)


def _batch(dp):
    g = torch.Generator().manual_seed(2)
    n = dp * M * MICRO
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def _micro(x, y, dp_rank, m):
    start = (dp_rank * M + m) * MICRO
    return x[start : start + MICRO], y[start : start + MICRO]


def _loss(model, x, y):
    return ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean()


def check_ddp_matches_global_batch(dp, overlap, bucket_size):
    state = cached_state()  # world = dp: every rank is a data-parallel replica
    assert state.dp_size == dp
    x, y = _batch(dp)
    ref = _model()
    _loss(ref, x, y).backward()

    model = DistributedDataParallel(_model(), state, overlap_grad_reduce=overlap, bucket_size=bucket_size)
    if bucket_size == 40:
        # reverse order, a bucket closes at >= 40 elements: [b2 4, w2 32, b1 8], [w1 48]
        assert [len(b.params) for b in model.buckets] == [3, 1]
    for it in range(2):  # the second iteration proves zero_grad_buffer resets everything
        model.zero_grad_buffer()
        with model.no_sync():
            xm, ym = _micro(x, y, state.dp_rank, 0)
            (_loss(model, xm, ym) / M).backward()
        if it == 0:  # no_sync: only this rank's first micro-batch, not reduced
            local = _model()
            (_loss(local, xm, ym) / M).backward()
            for p, q in zip(model.module.parameters(), local.parameters()):
                torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-7)
                assert p.grad is None
        for m in range(1, M):
            xm, ym = _micro(x, y, state.dp_rank, m)
            (_loss(model, xm, ym) / M).backward()
        if overlap:  # every bucket was launched during backward
            assert all(b.launched for b in model.buckets)
        else:
            assert not any(b.launched for b in model.buckets)
        finalize_model_grads([model], state)
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda s, n=name: f"{n}: {s}")


def check_bf16_accumulates_in_fp32(dp):
    state = cached_state()
    x, y = _batch(dp)
    model = DistributedDataParallel(_model(torch.bfloat16), state, bucket_size=30)
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in model.module.parameters()]
    ref = _model(torch.bfloat16)
    for r in range(dp):
        for m in range(M):
            ref.zero_grad()
            (_loss(ref, *_micro(x, y, r, m)) / M).backward()
            for e, q in zip(expected, ref.parameters()):
                assert q.grad.dtype == torch.bfloat16
                e += q.grad.float() / dp
    model.zero_grad_buffer()
    with model.no_sync():
        for m in range(M - 1):
            (_loss(model, *_micro(x, y, state.dp_rank, m)) / M).backward()
    (_loss(model, *_micro(x, y, state.dp_rank, M - 1)) / M).backward()
    finalize_model_grads([model], state)
    for p, e in zip(model.module.parameters(), expected):
        assert p.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32
        torch.testing.assert_close(p.main_grad, e, rtol=1e-6, atol=1e-9)


class _WithExpert(nn.Module):
    """A dense layer plus an 'expert' weight that differs per expert-parallel rank."""

    def __init__(self, ep_rank):
        super().__init__()
        torch.manual_seed(1)
        self.dense = nn.Linear(IN, OUT)
        torch.manual_seed(10 + ep_rank)
        self.expert = nn.Parameter(torch.randn(OUT, OUT))
        self.expert.allreduce = False

    def forward(self, x):
        return self.dense(x) @ self.expert


def check_expert_grads_over_expert_dp():
    state = cached_state(ep=2)  # world 4: dp 4 = ep 2 x edp 2
    x, y = _batch(4)
    model = DistributedDataParallel(_WithExpert(state.ep_rank), state, bucket_size=16)
    assert {b.group for b in model.buckets} == {state.dp_group, state.expert_dp_group}
    model.zero_grad_buffer()
    with model.no_sync():
        (_loss(model, *_micro(x, y, state.dp_rank, 0)) / M).backward()
    (_loss(model, *_micro(x, y, state.dp_rank, 1)) / M).backward()
    finalize_model_grads([model], state)
    # Reference: dense grads averaged over all 4 ranks; expert grads summed over the ranks that
    # hold the same expert (same ep_rank) and divided by dp = 4.
    dense_ref, expert_ref = None, torch.zeros(OUT, OUT)
    for rank in range(4):
        dp_rank, ep_rank = rank, state.grid.coords(rank)["ep"]
        ref = _WithExpert(ep_rank)
        for m in range(M):
            (_loss(ref, *_micro(x, y, dp_rank, m)) / M).backward()
        if ep_rank == state.ep_rank:
            expert_ref += ref.expert.grad / 4
        dense_ref = ref.dense.weight.grad / 4 if dense_ref is None else dense_ref + ref.dense.weight.grad / 4
    torch.testing.assert_close(model.module.dense.weight.main_grad, dense_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(model.module.expert.main_grad, expert_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("overlap, bucket_size", [(False, None), (True, None), (False, 40), (True, 40)])
def test_ddp_grads_equal_single_process_global_batch(dp, overlap, bucket_size):
    run_ranks(dp, check_ddp_matches_global_batch, dp, overlap, bucket_size)


def test_bf16_params_accumulate_in_fp32_main_grad():
    run_ranks(2, check_bf16_accumulates_in_fp32, 2)


def test_expert_params_reduce_over_expert_data_parallel_group():
    run_ranks(4, check_expert_grads_over_expert_dp)


def test_single_process_ddp_is_plain_accumulation():
    from megatron_lite.parallel.state import ParallelState

    state = ParallelState()
    x, y = _batch(1)
    model = DistributedDataParallel(_model(), state, overlap_grad_reduce=True, bucket_size=10)
    ref = _model()
    _loss(ref, x, y).backward()
    model.zero_grad_buffer()
    with model.no_sync():
        (_loss(model, *_micro(x, y, 0, 0)) / M).backward()
    (_loss(model, *_micro(x, y, 0, 1)) / M).backward()
    finalize_model_grads([model], state)
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-7)


def test_wrapping_a_module_twice_is_refused():
    from megatron_lite.parallel.state import ParallelState

    module = torch.nn.Linear(3, 2)
    DistributedDataParallel(module, ParallelState())
    with pytest.raises(ValueError, match="already wrapped"):
        DistributedDataParallel(module, ParallelState())


def _sequence_parallel_grads():
    state = cached_state(tp=2)  # dp 1: only the sequence-parallel sum over TP changes main_grad
    x, _ = _batch(2)
    torch.manual_seed(1)
    layer = nn.Linear(IN, OUT)
    for p in layer.parameters():  # replicated, each TP rank seeing only its sequence shard
        p.sequence_parallel = True
    model = DistributedDataParallel(layer, state)
    model.zero_grad_buffer()
    shard = x.chunk(2)[state.tp_rank]
    torch.tanh(model(shard)).sum().backward()
    finalize_model_grads([model], state)
    return [p.main_grad.clone() for p in layer.parameters()], x


def test_sequence_parallel_replicated_grads_are_summed_over_tp():
    """A replicated parameter marked ``sequence_parallel`` gets, after finalize_model_grads, the
    gradient of the whole sequence on every TP rank: the sum of the shards' (rtol 1e-6)."""
    for grads, x in run_ranks(2, _sequence_parallel_grads):
        torch.manual_seed(1)
        ref = nn.Linear(IN, OUT)
        torch.tanh(ref(x)).sum().backward()
        for g, p in zip(grads, ref.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=1e-7)
