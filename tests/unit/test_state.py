"""The rank grid, checked without processes for every factorisation of 1..64 ranks."""

import pytest

from megatron_lite.parallel.rank_grid import ParallelConfigError, RankGrid
from megatron_lite.parallel.state import ParallelState


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _shapes(max_world=64):
    for world in range(1, max_world + 1):
        for tp in _divisors(world):
            for pp in _divisors(world // tp):
                for cp in _divisors(world // (tp * pp)):
                    dp = world // (tp * pp * cp)
                    for ep in _divisors(dp):
                        yield world, tp, pp, cp, ep


def _reference_coords(rank, tp, cp, ep, dp):
    """Megatron's order tp-cp-ep-dp-pp written out directly with divmod (TP innermost)."""
    rest, t = divmod(rank, tp)
    rest, c = divmod(rest, cp)
    rest, e = divmod(rest, ep)
    p, d = divmod(rest, dp // ep)
    return {"tp": t, "cp": c, "ep": e, "edp": d, "pp": p, "dp": e + ep * d}


# group -> the reference coordinates that must be EQUAL inside one group
_FIXED = {
    "tp": ("cp", "dp", "pp"),
    "cp": ("tp", "dp", "pp"),
    "pp": ("tp", "cp", "dp"),
    "dp": ("tp", "cp", "pp"),
    "dp_cp": ("tp", "pp"),
    "mp": ("cp", "dp"),
    "tp_cp": ("dp", "pp"),
    "ep": ("tp", "cp", "edp", "pp"),
    "expert_dp": ("tp", "ep", "pp"),
}
_SIZE = {
    "tp": lambda tp, pp, cp, ep, dp: tp,
    "cp": lambda tp, pp, cp, ep, dp: cp,
    "pp": lambda tp, pp, cp, ep, dp: pp,
    "dp": lambda tp, pp, cp, ep, dp: dp,
    "dp_cp": lambda tp, pp, cp, ep, dp: dp * cp,
    "mp": lambda tp, pp, cp, ep, dp: tp * pp,
    "tp_cp": lambda tp, pp, cp, ep, dp: tp * cp,
    "ep": lambda tp, pp, cp, ep, dp: ep,
    "expert_dp": lambda tp, pp, cp, ep, dp: (dp // ep) * cp,
}


def test_every_factorisation_up_to_64_ranks():
    count = 0
    for world, tp, pp, cp, ep in _shapes():
        grid = RankGrid(world, tp=tp, pp=pp, cp=cp, ep=ep)
        dp = world // (tp * pp * cp)
        assert grid.dp == dp
        ref = [_reference_coords(r, tp, cp, ep, dp) for r in range(world)]
        for name, fixed in _FIXED.items():
            groups = grid.groups(name)
            # a partition of all ranks into groups of the expected size
            assert sorted(r for g in groups for r in g) == list(range(world)), (name, world, tp, pp, cp, ep)
            assert all(len(g) == _SIZE[name](tp, pp, cp, ep, dp) for g in groups), name
            # two ranks share a group exactly when their fixed coordinates agree
            by_key = {}
            for r in range(world):
                by_key.setdefault(tuple(ref[r][k] for k in fixed), []).append(r)
            assert sorted(by_key.values()) == sorted(groups), (name, world, tp, pp, cp, ep)
        for r in range(world):
            c = grid.coords(r)
            assert grid.rank_of(**c) == r
            assert c["ep"] + ep * c["edp"] == ref[r]["dp"]
        for ranks, emb in zip(grid.groups("pp"), grid.embedding_groups()):
            assert emb == sorted({ranks[0], ranks[-1]})
        count += 1
    assert count > 1000  # the loop really covered the space


def test_megatron_documented_example():
    # 16 ranks, tp 2, pp 4 -> dp 2 (the classic example from the Megatron-LM paper's code).
    grid = RankGrid(16, tp=2, pp=4)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert grid.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert grid.embedding_groups()[0] == [0, 12]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(world_size=8, tp=3), ["world size 8", "tensor-model-parallel-size 3"]),
        (dict(world_size=8, tp=2, pp=2, dp=3), ["data-parallel-size 3", "world size 8"]),
        (dict(world_size=8, tp=2, ep=3), ["expert-model-parallel-size 3"]),
        (dict(world_size=8, tp=0), ["tensor-model-parallel-size"]),
        (dict(world_size=4, tp=4, vpp=2), ["pipeline-model-parallel-size"]),
    ],
)
def test_bad_sizes_name_the_flags(kwargs, words):
    with pytest.raises(ParallelConfigError) as err:
        RankGrid(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_single_process_state_needs_no_distributed():
    state = ParallelState()
    assert (state.tp_size, state.pp_size, state.dp_size) == (1, 1, 1)
    assert state.tp_group is None and state.is_first_stage() and state.is_last_stage()
    with pytest.raises(ParallelConfigError):
        ParallelState(tp=2)


@pytest.mark.parametrize("world, tp, cp, inner", [(16, 2, 4, 2), (8, 1, 8, 4), (8, 1, 8, 2), (12, 1, 6, 3), (4, 1, 4, 1)])
def test_hierarchical_cp_groups_cut_each_cp_group(world, tp, cp, inner):
    """a2a+p2p: every CP group [c_0 .. c_{cp-1}] (global ranks) is cut into all-to-all groups of
    ``inner`` consecutive CP ranks and ring groups of the CP ranks ``i, i + inner, ...``; together they
    cover each rank once, and (all-to-all index, position in it) = divmod(cp rank, inner)."""
    grid = RankGrid(world, tp=tp, cp=cp)
    a2a, ring = grid.hierarchical_cp_groups(inner)
    for groups, size in ((a2a, inner), (ring, cp // inner)):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    for rank in range(world):
        cp_ranks = grid.group_of("cp", rank)
        outer, pos = divmod(grid.coords(rank)["cp"], inner)
        mine_a2a = next(g for g in a2a if rank in g)
        mine_ring = next(g for g in ring if rank in g)
        assert mine_a2a == cp_ranks[outer * inner:(outer + 1) * inner]
        assert mine_ring == [cp_ranks[pos + inner * o] for o in range(cp // inner)]
        assert mine_ring.index(rank) == outer  # the ring rank is the all-to-all group's index


def test_hierarchical_cp_groups_megatron_example():
    """Megatron-LM's documented two-level cut of 16 ranks as 2 x 8: [g0, g1], [g2, g3], ... then
    [g0, g2, ..., g14], [g1, g3, ..., g15] (here one CP group of 16)."""
    a2a, ring = RankGrid(16, cp=16).hierarchical_cp_groups(2)
    assert a2a == [[2 * i, 2 * i + 1] for i in range(8)]
    assert ring == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    with pytest.raises(ParallelConfigError, match="all-to-all size 3 does not divide --context-parallel-size 16"):
        RankGrid(16, cp=16).hierarchical_cp_groups(3)


def test_single_process_hierarchical_state_has_groups_of_one():
    state = ParallelState(world_size=1, rank=0, hcp=[1, 1])
    assert state.group("cp_a2a") is None and state.group("cp_ring") is None
    assert state.ranks("cp_a2a") == state.ranks("cp_ring") == [0]
    assert state.describe().endswith(", cp as a2a 1 x ring 1")


@pytest.mark.parametrize("hcp", [(2, 1), (1, 1, 1)])
def test_hierarchical_sizes_must_multiply_to_cp(hcp):
    with pytest.raises(ParallelConfigError, match="product is --context-parallel-size 1"):
        ParallelState(world_size=1, rank=0, hcp=hcp)
