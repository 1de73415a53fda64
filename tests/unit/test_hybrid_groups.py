"""The hybrid-sharding groups of the rank grid: dp_shard (consecutive blocks of each DP x CP group)
and dp_replicate (the same position in every block); with CP the blocks hold whole CP groups."""

import pytest

from megatron_lite.parallel.state import ParallelConfigError, RankGrid


def test_dp4_two_instances():
    grid = RankGrid(4, dist_opt_instances=2)
    assert grid.groups("dp_shard") == [[0, 1], [2, 3]]
    assert grid.groups("dp_replicate") == [[0, 2], [1, 3]]


def test_with_tp_and_cp_the_blocks_are_built_from_the_dp_cp_ranks():
    grid = RankGrid(16, tp=2, cp=2, dist_opt_instances=2)  # dp 4
    assert grid.groups("dp_cp")[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    shard = grid.groups("dp_shard")
    assert shard[:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert grid.groups("dp_replicate")[:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    for ranks in shard:  # every CP group lies inside one shard block
        for cp_group in grid.groups("cp"):
            assert set(cp_group) <= set(ranks) or not set(cp_group) & set(ranks)


def test_one_instance_shards_over_all_of_dp_x_cp():
    grid = RankGrid(8, cp=2)
    assert grid.groups("dp_shard") == grid.groups("dp_cp")
    assert all(len(r) == 1 for r in grid.groups("dp_replicate"))


@pytest.mark.parametrize("instances", [0, 3])
def test_instances_must_divide_dp(instances):
    with pytest.raises(ParallelConfigError, match="num-distributed-optimizer-instances"):
        RankGrid(4, dist_opt_instances=instances)
