"""Dispatch then combine with tagged identity experts returns the probability-weighted input.

Expert e multiplies its rows by its weight and by ``e + 1``, so every token's output must be
``x * sum_e p_e (e + 1)``: a token sent to a wrong expert, lost, or duplicated changes the result.
Checked for both dispatchers at EP 1/2/4 (and EP 2 x TP 2 with sequence parallelism, where
each expert-tensor rank returns half of the output and the dispatcher sums the halves), with and
without capacity dropping / padding, forward and both gradients (input and routing weights)
against single-process autograd of that formula. fp32, rtol 1e-5.
"""

import pytest
import torch

from megatron_lite.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from megatron_lite.moe.routing import drop_to_capacity, expert_capacity, topk_routing
from megatron_lite.parallel import comm
from tests.harness import cached_state, run_ranks
from tests.moe_helpers import moe_config

TOKENS, HIDDEN, EXPERTS, TOPK = 12, 8, 8, 2


def _tagged_identity(dispatcher, etp_size):
    def experts(rows, weights, tokens_per_expert):
        tags = torch.repeat_interleave(
            torch.arange(len(tokens_per_expert), dtype=rows.dtype) + dispatcher.first + 1,
            torch.tensor(tokens_per_expert))
        return rows * (weights * tags).unsqueeze(-1) / etp_size

    return experts


def _routing(seed, capacity_factor, pad):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    probs, rmap = topk_routing(logits, TOPK)
    if capacity_factor is not None:
        capacity = expert_capacity(TOKENS, EXPERTS, TOPK, capacity_factor)
        probs, rmap, _ = drop_to_capacity(probs, rmap, capacity, pad_to_capacity=pad)
    return probs, rmap


def check_dispatch(kind, ep, tp, capacity_factor, pad):
    state = cached_state(ep=ep, tp=tp)
    config = moe_config(num_experts=EXPERTS, moe_token_dispatcher_type=kind, sequence_parallel=tp > 1,
                        tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    dispatcher = (AllToAllDispatcher if kind == "alltoall" else AllGatherDispatcher)(config, state)
    seed = 100 + state.rank
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    dy = torch.randn(TOKENS, HIDDEN, generator=gen)
    probs, rmap = _routing(seed, capacity_factor, pad)

    xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
    ref = xr * (pr * rmap * torch.arange(1, EXPERTS + 1, dtype=torch.float32)).sum(1, keepdim=True)
    ref.backward(dy)

    xd, pd = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out = dispatcher.run(xd, pd, rmap, _tagged_identity(dispatcher, comm.group_size(state.tp_group)))
    out.backward(dy)
    for actual, expected, what in ((out, ref, "output"), (xd.grad, xr.grad, "input grad"), (pd.grad, pr.grad, "probs grad")):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m, w=what: f"{w}: {m}")
    return True


CASES = [(ep, tp, cf, pad) for ep, tp in ((1, 1), (2, 1), (4, 1), (2, 2))
         for cf, pad in ((None, False), (1.0, False), (1.0, True))]


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
@pytest.mark.parametrize("ep,tp,capacity_factor,pad", CASES)
def test_dispatch_combine_identity(kind, ep, tp, capacity_factor, pad):
    assert all(run_ranks(ep * tp, check_dispatch, kind, ep, tp, capacity_factor, pad))


def check_bytes_sent(ep):
    """The all-to-all sends every routed slot whose expert lives on another EP rank, twice (there
    and back), ``hidden * 4`` bytes each."""
    state = cached_state(ep=ep)
    config = moe_config(num_experts=EXPERTS, moe_token_dispatcher_type="alltoall")
    dispatcher = AllToAllDispatcher(config, state)
    probs, rmap = _routing(7 + state.rank, None, False)
    dispatcher.run(torch.randn(TOKENS, HIDDEN), probs, rmap, _tagged_identity(dispatcher, 1))
    local = EXPERTS // ep
    remote = int(rmap.sum()) - int(rmap[:, state.ep_rank * local:(state.ep_rank + 1) * local].sum())
    return dispatcher.bytes_sent == 2 * remote * HIDDEN * 4


def test_alltoall_bytes_match_the_routing():
    assert all(run_ranks(4, check_bytes_sent, 4))
