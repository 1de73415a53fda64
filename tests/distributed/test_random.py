"""Model-parallel RNG: reproducible masks, distinct across TP ranks, identical across DP ranks,
and replayed exactly by activation checkpointing."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.parallel.random import checkpoint, model_parallel_seed
from megatron_lite.parallel.state import ParallelState
from tests.harness import cached_state, run_ranks


def _masks(state, seed):
    model_parallel_seed(seed, state)
    default = F.dropout(torch.ones(64), p=0.5) > 0
    with state.rng_tracker.fork():
        tp_region = F.dropout(torch.ones(64), p=0.5) > 0
    return default, tp_region


def check_masks(tp):
    state = cached_state(tp=tp)  # 4 ranks: tp x dp
    default, tp_region = _masks(state, 1234)
    again_default, again_tp = _masks(state, 1234)
    assert torch.equal(default, again_default) and torch.equal(tp_region, again_tp), "same seed, same masks"
    other_default, _ = _masks(state, 99)
    assert not torch.equal(default, other_default), "a different seed gives different masks"

    world = dist.get_world_size()
    gathered = [torch.empty(2, 64, dtype=torch.bool) for _ in range(world)]
    dist.all_gather(gathered, torch.stack([default, tp_region]))
    for r in range(world):
        # The default stream is the same on every rank of a pipeline stage (all TP and DP ranks).
        assert torch.equal(gathered[r][0], default)
        same_tp_rank = state.grid.coords(r)["tp"] == state.tp_rank
        # Inside TP regions: equal exactly when the TP rank is equal (across DP), different otherwise.
        assert torch.equal(gathered[r][1], tp_region) == same_tp_rank, f"rank {r} vs {state.rank}"


def test_masks_across_tp_and_dp_ranks():
    run_ranks(4, check_masks, 2)


def _block(tracker):
    def block(x, w):
        h = F.dropout(x @ w, p=0.3)
        with tracker.fork():
            h = F.dropout(torch.tanh(h), p=0.3)
        return h.sin().sum(dim=-1)

    return block


def test_checkpoint_replays_dropout_and_restores_rng():
    model_parallel_seed(7, ParallelState())
    x0, w0 = torch.randn(5, 8), torch.randn(8, 8)

    def run(use_checkpoint):
        state = ParallelState()
        model_parallel_seed(7, state)
        block = _block(state.rng_tracker)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = checkpoint(block, x, w, tracker=state.rng_tracker) if use_checkpoint else block(x, w)
        torch.rand(3)  # draws between forward and backward (later layers' dropout) on both streams
        with state.rng_tracker.fork():
            torch.rand(3)
        y.sum().backward()
        after = (torch.get_rng_state(), state.rng_tracker.get_states())
        return y.detach(), x.grad, w.grad, after

    y_ref, dx_ref, dw_ref, after_ref = run(False)
    y, dx, dw, after = run(True)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-6, atol=1e-7)
    # After forward + backward the generators are where an un-checkpointed run leaves them.
    assert torch.equal(after[0], after_ref[0])
    for name, state in after_ref[1].items():
        assert torch.equal(after[1][name], state)
    assert (dx != 0).any()  # dropout kept something, so the comparison means something
