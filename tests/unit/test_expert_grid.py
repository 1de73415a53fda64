"""The folded expert grid (--expert-tensor-parallel-size independent of --tensor-model-parallel-size):
each pipeline stage's ranks re-cut as ETP x EP x expert-DP in Megatron-LM's expert order tp-ep-dp-pp
(ETP innermost, pipeline outermost), the dense groups untouched, and sizes that do not divide refused
naming both expert flags."""

import itertools
from types import SimpleNamespace

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint.expert_files import check_expert_grid, model_file_for, writes_model_file
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.parallel.rank_grid import ParallelConfigError, RankGrid
from tests.cli_errors import parse_refused


def test_worked_example_tp4_pp2_with_etp1_ep4():
    """16 ranks, attention TP 4 x DP 2 x PP 2; experts ETP 1 x EP 4 x expert-DP 2 per stage of 8 ranks."""
    grid = RankGrid(16, tp=4, pp=2, ep=4, etp=1)
    assert grid.folded and grid.edp == 2
    assert grid.groups("tp") == [list(range(4 * i, 4 * i + 4)) for i in range(4)]  # the attention layout is unchanged
    assert grid.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert grid.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert grid.groups("expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert grid.groups("etp") == [[r] for r in range(16)]
    assert grid.coords(13) == {"tp": 1, "cp": 0, "ep": 1, "edp": 1, "pp": 1, "dp": 1, "etp": 0}


def test_worked_example_tp1_with_etp2_ep2():
    """8 ranks of DP 8 (TP 1); experts ETP 2 x EP 2 x expert-DP 2."""
    grid = RankGrid(8, ep=2, etp=2)
    assert grid.folded
    assert grid.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups("dp") == [list(range(8))]


@pytest.mark.parametrize("cp, ep_groups, edp_groups", [
    (4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),  # CP 4 x DP 1: the 4 CP ranks hold one expert each
    (2, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),  # CP 2 x DP 2
])
def test_expert_parallelism_spans_context_parallel_ranks(cp, ep_groups, edp_groups):
    """EP 4 on 4 ranks at DP 4 / CP: EP does not divide DP, so the experts fold over the CP x DP ranks
    (Megatron-LM: EP x expert-DP = TP x CP x DP / ETP); the attention's CP groups are unchanged."""
    grid = RankGrid(4, cp=cp, ep=4, etp=1)
    assert grid.folded and grid.edp == 1 and grid.expert_dp_cp == 1
    assert grid.groups("ep") == ep_groups and grid.groups("expert_dp") == edp_groups
    assert grid.groups("cp") == RankGrid(4, cp=cp).groups("cp")
    assert [grid.coords(r)["ep"] for r in range(4)] == [0, 1, 2, 3]


def _shapes():
    for world in (4, 8, 12, 16):
        for tp, pp, cp, ep, etp in itertools.product((1, 2, 4), (1, 2), (1, 2), (1, 2, 4), (1, 2, 4)):
            stage = world // pp
            if world % (tp * pp * cp) == 0 and stage % (etp * ep) == 0:
                yield world, tp, pp, cp, ep, etp


def test_every_folded_grid_is_megatrons_mixed_radix_order():
    """Every rank's expert coordinates are the digits of its rank in [pp, edp, ep, etp] (ETP fastest), each
    group fixes all but one of them, and the dense coordinates are those of the grid with EP 1."""
    seen = 0
    for world, tp, pp, cp, ep, etp in _shapes():
        grid = RankGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        if not grid.folded:
            continue
        seen += 1
        edp = world // (pp * etp * ep)
        dense = RankGrid(world, tp=tp, pp=pp, cp=cp)
        for rank in range(world):
            rest, e_tp = divmod(rank, etp)
            rest, e_p = divmod(rest, ep)
            p, e_dp = divmod(rest, edp)
            c = grid.coords(rank)
            assert (c["etp"], c["ep"], c["edp"], c["pp"]) == (e_tp, e_p, e_dp, p), (world, tp, pp, cp, ep, etp, rank)
            assert {k: c[k] for k in ("tp", "cp", "dp", "pp")} == {k: dense.coords(rank)[k] for k in ("tp", "cp", "dp", "pp")}
        for name, varying in (("etp", "etp"), ("ep", "ep"), ("expert_dp", "edp")):
            for ranks in grid.groups(name):
                coords = [grid.coords(r) for r in ranks]
                fixed = {k for k in ("etp", "ep", "edp", "pp") if k != varying}
                assert all(all(x[k] == coords[0][k] for k in fixed) for x in coords), (name, ranks)
                assert sorted(x[varying] for x in coords) == list(range(len(ranks)))
    assert seen > 20


@pytest.mark.parametrize("tp, ep, etp, folded", [(2, 2, None, False), (2, 2, 1, False), (2, 2, 2, False),
                                                 (2, 4, 1, True), (1, 1, 2, True), (1, 2, 2, True)])
def test_folding_only_where_the_unfolded_grid_cannot_hold_the_experts(tp, ep, etp, folded):
    """EP dividing DP with ETP 1 or TP keeps the existing layout (EP inside DP); the rest folds."""
    assert RankGrid(4, tp=tp, ep=ep, etp=etp).folded == folded


@pytest.mark.parametrize("kwargs", [dict(world_size=4, tp=2, ep=3, etp=1), dict(world_size=4, tp=1, ep=2, etp=4),
                                    dict(world_size=8, tp=2, pp=2, ep=2, etp=4)])
def test_expert_sizes_that_do_not_divide_a_stage_are_refused(kwargs):
    with pytest.raises(ParallelConfigError, match="--expert-tensor-parallel-size .* x --expert-model-parallel-size"):
        RankGrid(**kwargs)


@pytest.mark.parametrize("etp", ["1", "2"])
def test_a_dense_model_refuses_an_expert_tensor_parallel_size(capsys, etp):
    """It was taken and did nothing (the planner and the converter refuse it for a dense model)."""
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "64", "--mock-data", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", etp]
    parse_refused(capsys, argv, f"--expert-tensor-parallel-size {etp}", "--num-experts", "drop it", world_size=2)
    assert parse_args(argv + ["--num-experts", "2"], world_size=2).moe.expert_tensor_parallel_size == int(etp)


def _rank_state(grid, rank):
    c = grid.coords(rank)
    return SimpleNamespace(grid=grid, rank=rank, world_size=grid.world_size, folded=grid.folded, etp_size=grid.expert_tp,
                           tp_rank=c["tp"], pp_rank=c["pp"], ep_rank=c["ep"], etp_rank=c["etp"], ep_size=grid.ep,
                           expert_dp_rank=c["edp"], cp_rank=c["cp"])


def test_folded_torch_files_hold_every_shard_once_and_every_rank_finds_its_own():
    """Torch format under a folded grid: the writers' files are distinct, hold every dense (TP) shard and
    every expert (EP, ETP) shard of every stage, and each rank's file is one a writer wrote."""
    for world, tp, pp, cp, ep, etp in _shapes():
        grid = RankGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        if not grid.folded:
            continue
        states = [_rank_state(grid, r) for r in range(world)]
        written = [model_file_for("ckpt", 1, s) for s in states if writes_model_file(s)]
        assert len(written) == len(set(written)), (world, tp, pp, cp, ep, etp)
        assert {model_file_for("ckpt", 1, s) for s in states} == set(written)
        writers = [s for s in states if writes_model_file(s)]
        assert {(s.pp_rank, s.tp_rank) for s in writers} == {(p, t) for p in range(pp) for t in range(tp)}
        assert {(s.pp_rank, s.ep_rank, s.etp_rank) for s in writers} == set(
            itertools.product(range(pp), range(ep), range(etp)))


def test_torch_checkpoint_of_a_folded_grid_resumes_only_at_its_expert_sizes():
    saved = {"tp_size": 1, "pp_size": 1, "ep_size": 2, "etp_size": 2, "expert_grid_folded": True}
    here = _rank_state(RankGrid(4, tp=2, ep=4, etp=1), 0)
    with pytest.raises(CheckpointError, match="ETP 2 .* this run has TP 2, PP 1, EP 4, ETP 1 .*--tensor-model-parallel-size 1"
                                              ", --expert-model-parallel-size 2, --expert-tensor-parallel-size 2.*"
                                              r"convert\.py with --target-data-parallel-size 2\).*torch_dist"):
        check_expert_grid("ckpt", saved, here)
    check_expert_grid("ckpt", saved, _rank_state(RankGrid(4, ep=2, etp=2), 3))  # the same sizes load
    check_expert_grid("ckpt", {"tp_size": 2}, _rank_state(RankGrid(4, tp=2, ep=2), 1))  # unfolded: not its business


@pytest.mark.parametrize("grid, fix", [
    (RankGrid(4, tp=2, ep=2), "set --tensor-model-parallel-size 1,"),  # ETP 2 = TP 2 there: the unfolded grid
    (RankGrid(4, tp=2, ep=2, etp=2), "set --tensor-model-parallel-size 1,"),
    (RankGrid(4, cp=2, ep=2, etp=2), None),  # same sizes, CP 2 x DP 2 instead of DP 4: folded alike, loads
])
def test_folded_tp1_etp2_torch_checkpoint_at_tp2_names_tp_and_torch_dist(grid, fix):
    """TP 1 with ETP 2 x EP 2 saved in torch format, resumed at TP 2 (ETP 2 by default): the refusal said
    'saved with expert-tensor-parallel-size 2 ..., this run uses 2; match --expert-tensor-parallel-size',
    naming a flag that already matched. It names the size that differs, the rule and torch_dist."""
    saved = {"tp_size": 1, "pp_size": 1, "ep_size": 2, "etp_size": 2, "expert_grid_folded": True}
    if fix is None:
        return check_expert_grid("ckpt", saved, _rank_state(grid, 3))
    with pytest.raises(CheckpointError) as err:
        check_expert_grid("ckpt", saved, _rank_state(grid, 0))
    message = str(err.value)
    assert "resumes only at its own sizes" in message and fix in message and "--ckpt-format torch_dist" in message
    assert "--expert-tensor-parallel-size" not in message and "\n" not in message, message
    assert "convert.py)" in message, message  # this run's experts do not fold: no data-parallel size to name


def test_size_mismatch_of_a_folded_torch_checkpoint_advises_the_converter():
    """The converter reads and writes a folded grid's torch-format checkpoint: another EP (same ETP)
    is refused naming --expert-model-parallel-size, the converter and torch_dist; an unfolded one too."""
    from megatron_lite.checkpoint.compat import check_sizes

    saved = {"tp_size": 1, "pp_size": 1, "ep_size": 1, "etp_size": 2, "expert_grid_folded": True}
    here = SimpleNamespace(**vars(_rank_state(RankGrid(4, ep=2, etp=2), 0)), tp_size=1, pp_size=1)
    with pytest.raises(CheckpointError) as err:
        check_sizes("ckpt", saved, here)
    assert "--expert-model-parallel-size" in str(err.value) and "torch_dist" in str(err.value)
    assert "tools/checkpoint/convert.py" in str(err.value)
    unfolded = SimpleNamespace(**vars(_rank_state(RankGrid(4, ep=2), 0)), tp_size=1, pp_size=1)
    with pytest.raises(CheckpointError, match="pass --expert-model-parallel-size 1, or convert it with tools/checkpoint/convert.py --target-expert-parallel-size 2"):
        check_sizes("ckpt", {"tp_size": 1, "pp_size": 1, "ep_size": 1}, unfolded)


@pytest.mark.parametrize("sizes, groups", [
    (dict(tp=2, cp=2, ep=2, etp=1), [[0, 2], [1, 3]]),  # folded: each whole expert's copies on the 2 CP ranks
    (dict(tp=2, cp=2, ep=2, etp=2), [[0, 1], [2, 3]]),  # folded, EP over CP: each expert sees whole sequences
    (dict(cp=2, etp=2), [[0, 1], [2, 3]]),  # folded TP1 x CP2 x DP2 at ETP2: never across micro-batches
    (dict(tp=2, cp=2), [[0, 1, 2, 3]]),  # unfolded: tensor x context parallelism, as the dense layers
    (dict(cp=2, ep=2), [[0, 1], [2, 3]]),  # unfolded CP2 x DP2 x EP2: the CP group
])
def test_expert_amax_groups_worked_examples(sizes, groups):
    assert RankGrid(4, **sizes).groups("expert_amax") == groups


def test_every_folded_expert_amax_group_holds_the_copies_fed_the_same_micro_batches():
    """The FP8 experts' amax group: ranks holding the same experts (pipeline stage and EP rank) whose
    ETP x EP blocks take tokens from the same data-parallel ranks; every such rank is in it, no other."""
    for world, tp, pp, cp, ep, etp in _shapes():
        grid = RankGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        if not grid.folded:
            continue
        coords = [grid.coords(r) for r in range(world)]
        sources = [frozenset(coords[o]["dp"] for o in range(world)
                             if (coords[o]["pp"], coords[o]["edp"]) == (c["pp"], c["edp"])) for c in coords]
        key = [(c["pp"], c["ep"], sources[r]) for r, c in enumerate(coords)]
        groups = grid.groups("expert_amax")
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:
            assert all(key[r] == key[g[0]] for r in g)
            assert sorted(g) == [r for r in range(world) if key[r] == key[g[0]]], (world, tp, pp, cp, ep, etp, g)
            assert set(grid.group_of("etp", g[0])) <= set(g)
