"""The hybrid-sharding groups of the rank grid: dp_shard (consecutive blocks of each DP x CP group)
and dp_replicate (the same position in every block); with CP the blocks hold whole CP groups when
the number of instances divides DP, and split them otherwise (it need only divide DP x CP). The
expert-DP x CP groups are cut the same way (expert_dp_shard, expert_dp_replicate)."""

import pytest

from megatron_lite.parallel.rank_grid import ParallelConfigError, RankGrid


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


@pytest.mark.parametrize("cp, instances", [(1, 0), (1, 3), (2, 3), (4, 8)])
def test_instances_must_divide_dp_x_cp(cp, instances):
    with pytest.raises(ParallelConfigError, match=f"--num-distributed-optimizer-instances {instances} .* "
                                                  f"data-parallel size {4 // cp} x context-parallel size {cp}"):
        RankGrid(4, cp=cp, dist_opt_instances=instances)


@pytest.mark.parametrize("dp, instances", [(1, 2), (1, 4), (2, 4)])
def test_instances_may_split_context_parallel_groups(dp, instances):
    """Megatron-LM shards the optimizer over DP x CP, so N need only divide DP x CP (it was refused
    unless N divided DP): at CP 4 x DP 1 in 2 instances each block is 2 of the 4 CP ranks."""
    grid = RankGrid(4 * dp, cp=4, dist_opt_instances=instances)
    size = 4 * dp // instances
    for dp_cp in grid.groups("dp_cp"):
        blocks = [dp_cp[i : i + size] for i in range(0, len(dp_cp), size)]
        assert all(b in grid.groups("dp_shard") for b in blocks)
        assert all(list(col) in grid.groups("dp_replicate") for col in zip(*blocks))
    assert RankGrid(4, cp=4, dist_opt_instances=2).groups("dp_shard") == [[0, 1], [2, 3]]
    assert RankGrid(4, cp=4, dist_opt_instances=2).groups("dp_replicate") == [[0, 2], [1, 3]]


def test_expert_groups_are_cut_into_instances_too():
    # world 4, EP 2: expert-DP groups [0, 2] and [1, 3]; 2 instances leave one rank per expert shard
    grid = RankGrid(4, ep=2, dist_opt_instances=2)
    assert grid.groups("expert_dp") == [[0, 2], [1, 3]]
    assert grid.groups("expert_dp_shard") == [[0], [2], [1], [3]]
    assert grid.groups("expert_dp_replicate") == [[0, 2], [1, 3]]
    assert grid.groups("dp_shard") == [[0, 1], [2, 3]]


def test_an_expert_block_lies_inside_the_dense_block_of_its_instance():
    grid = RankGrid(16, cp=2, ep=2, dist_opt_instances=2)  # dp 8, edp 4: expert-DP x CP groups of 8
    expert_shard = grid.groups("expert_dp_shard")
    assert expert_shard[:2] == [[0, 1, 4, 5], [8, 9, 12, 13]]  # ep rank 0 (rank = cp + 2 ep + 4 edp)
    assert grid.groups("expert_dp_replicate")[:4] == [[0, 8], [1, 9], [4, 12], [5, 13]]
    dense = grid.groups("dp_shard")
    for block in expert_shard:  # each has half of its expert-DP x CP group, inside one dense block
        assert len(block) == 4 and any(set(block) <= set(d) for d in dense)


def test_one_instance_shards_experts_over_all_of_expert_dp():
    grid = RankGrid(8, ep=2)
    assert grid.groups("expert_dp_shard") == grid.groups("expert_dp")
    assert all(len(r) == 1 for r in grid.groups("expert_dp_replicate"))


@pytest.mark.parametrize("world, ep, instances", [(4, 4, 2), (8, 4, 4)])
def test_instances_must_divide_the_expert_data_parallel_size(world, ep, instances):
    # N divides DP (4, 8) but not DP / EP (1, 2)
    with pytest.raises(ParallelConfigError, match="--num-distributed-optimizer-instances .* --expert-model-parallel-size"):
        RankGrid(world, ep=ep, dist_opt_instances=instances)


def test_context_parallelism_counts_in_the_expert_data_parallel_size():
    # DP 2 / EP 2 = 1, but the expert group spans CP 2: two instances of one rank each
    grid = RankGrid(4, cp=2, ep=2, dist_opt_instances=2)
    assert grid.groups("expert_dp") == [[0, 1], [2, 3]]
    assert grid.groups("expert_dp_shard") == [[0], [1], [2], [3]]


def test_expert_instances_refusal_counts_a_folded_grid_right():
    # folded (ETP 1 at TP 2): the expert-DP is TP 2 x CP 4 x DP 1 / (ETP 1 x EP 4) = 2, not DP x CP / EP = 1
    with pytest.raises(ParallelConfigError) as err:
        RankGrid(8, tp=2, cp=4, ep=4, etp=1, dist_opt_instances=4)
    message = str(err.value)
    assert "expert data-parallel size 2 (tensor 2 x context 4 x data 1 / (--expert-tensor-parallel-size 1 x " \
           "--expert-model-parallel-size 4))" in message, message
