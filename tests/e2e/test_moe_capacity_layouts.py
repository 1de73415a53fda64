"""MoE capacity is counted per rank, from the tokens that rank routes (as in Megatron-LM).

``--moe-expert-capacity-factor f`` gives each expert ``ceil(T * k / E * f)`` slots, ``T`` being the
tokens the router sees on that rank. Data, expert and pipeline parallelism route whole micro-batches
(``T`` = micro-batch x sequence, as in one process): those layouts reproduce the one-process run
exactly, drops included (test_pretrain_moe.py: ``ep2_capacity_shared_grouped``, ``ep2_pp2``,
``ep2_dp2_zero3``). Sequence parallelism (TP > 1, which MoE requires it with) and context
parallelism split every sequence, so a rank routes ``T / TP`` (``T / CP``) tokens against
``ceil(T / TP * k / E * f)`` slots: an expert popular in one part of the sequences drops tokens one
process keeps. With a capacity that binds, such a layout is a different (equally valid) model; with
one that drops nothing, it is the same model again. This is what an EP2 checkpoint resumed at
TP2 + SP shows from its first resumed step.
"""

import pytest
import torch

from megatron_lite.moe.routing import drop_to_capacity, expert_capacity
from tests.e2e.test_pretrain_gpt import _argv
from tests.e2e.test_pretrain_moe import ITERS, MOE, MOE_B
from tests.trajectory import assert_same_trajectory, ranks_trajectory, run_script


def test_capacity_per_sequence_part_drops_what_the_whole_keeps():
    """8 tokens, 2 experts, top-1, factor 1: the first half of the sequence goes to expert 0, the
    second to expert 1. One process: 4 slots per expert, nothing dropped. Two SP ranks (4 tokens
    each): 2 slots per expert and rank, so each rank drops 2 of its 4."""
    routing_map = torch.zeros(8, 2, dtype=torch.bool)
    routing_map[:4, 0] = routing_map[4:, 1] = True
    probs = routing_map.float()
    whole = drop_to_capacity(probs, routing_map, expert_capacity(8, 2, 1, 1.0))
    halves = [drop_to_capacity(probs[s], routing_map[s], expert_capacity(4, 2, 1, 1.0)) for s in (slice(0, 4), slice(4, 8))]
    assert whole[2] == 0 and torch.equal(whole[1], routing_map)
    assert [h[2] for h in halves] == [2, 2]
    assert not torch.equal(torch.cat([h[1] for h in halves]), routing_map)
    # a factor that leaves room for the whole load of one part drops nothing anywhere
    assert all(drop_to_capacity(probs[s], routing_map[s], expert_capacity(4, 2, 1, 2.0))[2] == 0
               for s in (slice(0, 4), slice(4, 8)))


NO_DROP = ["--moe-expert-capacity-factor", "4.0"]  # capacity min(T, 2T): nothing is ever dropped
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("capacity")
    return {name: run_script("pretrain_gpt", _argv(str(tmp / name), ITERS, MOE + MOE_B + extra))
            for name, extra in (("binding", []), ("no_drop", NO_DROP))}


@pytest.mark.parametrize("capacity, layout, world, same", [
    ("binding", ["--expert-model-parallel-size", "2"], 2, True),  # whole micro-batches per rank
    ("binding", TP2_SP, 2, False),  # half of every sequence per rank: other tokens dropped
    ("no_drop", TP2_SP, 2, True),  # the same layout, nothing dropped: the same model
], ids=["ep2_binding", "tp2_sp_binding", "tp2_sp_no_drop"])
def test_which_layouts_reproduce_one_process_with_a_capacity_factor(tmp_path, single, capacity, layout, world, same):
    extra = MOE + MOE_B + (NO_DROP if capacity == "no_drop" else []) + layout
    parallel = ranks_trajectory(world, "pretrain_gpt", _argv(str(tmp_path / "run"), ITERS, extra))
    if same:
        assert_same_trajectory(parallel, single[capacity], steps=ITERS)
    else:
        with pytest.raises(AssertionError):
            assert_same_trajectory(parallel, single[capacity], steps=ITERS)
        assert parallel.losses[-1] < parallel.losses[0]  # a different model, still training
