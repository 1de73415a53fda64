"""Hybrid sharding with expert parameters, at the level of buckets and optimizer shards.

World 4 = EP 2 x expert-DP 2 (DP 4), ``--num-distributed-optimizer-instances`` 1 or 2. The model of
test_data_parallel (a dense layer and an 'expert' weight that differs per EP rank) is wrapped in DDP
with the distributed optimizer (ZeRO-1), or with sharded gradients (ZeRO-2) or sharded gradients and
parameters (ZeRO-3) at 2 instances (HSDP). With 2 instances the expert buckets shard over one
expert-DP rank (the whole bucket) and are all-reduced over the two instances; the dense ones shard
over 2 ranks.
Checked: each bucket's group and replicate group sizes, the shard this rank owns (its length and
values: the reference gradient averaged over DP, within rtol 1e-5), that the pieces of every
instance cover each parameter exactly once, and the optimizer's grad norm against the norm of the
whole model's gradient (each EP rank's expert once, the dense weights once) within rtol 1e-5; and
the model-state bytes this rank holds against the memory model's formula, exactly.
"""

import math
from fractions import Fraction

import pytest
import torch

from megatron_lite.config import Config
from megatron_lite.optim import build_optimizer
from megatron_lite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from megatron_lite.parallel.fsdp import FullyShardedDataParallel
from megatron_lite.perf.model_state import formula_model_state_bytes, measured_model_state_bytes
from tests.distributed.test_data_parallel import IN, OUT, _batch, _loss, _WithExpert
from tests.harness import cached_state, run_ranks


def _reference(state, x, y):
    """This rank's expected gradients ({name: sum over the 4 DP ranks' batches / 4}; the expert's over
    the ranks of its EP rank only) and the norm of the whole model's gradient (each expert once)."""
    grads = {}  # (ep rank, name) -> gradient
    for rank in range(4):
        ep_rank = state.grid.coords(rank)["ep"]
        ref = _WithExpert(ep_rank)
        _loss(ref, x[rank::4], y[rank::4]).backward()
        for name, p in ref.named_parameters():
            key = (ep_rank if name == "expert" else None, name)
            grads[key] = grads.get(key, 0) + p.grad / 4
    norm = math.sqrt(sum(g.square().sum().item() for g in grads.values()))
    mine = {name: g for (ep_rank, name), g in grads.items() if ep_rank in (None, state.ep_rank)}
    return mine, norm


def check_expert_shards(instances, strategy="optim"):
    state = cached_state(ep=2, dist_opt_instances=instances)
    x, y = _batch(4)
    if strategy == "optim_grads_params":  # no unit inside: the root unit, one bucket per parameter
        model = FullyShardedDataParallel(_WithExpert(state.ep_rank), state, bucket_size=16)
    else:
        model = DistributedDataParallel(_WithExpert(state.ep_rank), state, bucket_size=16, strategy=strategy)
    cfg = Config()
    cfg.parallel.use_distributed_optimizer = True
    cfg.parallel.data_parallel_sharding_strategy = strategy
    cfg.parallel.num_distributed_optimizer_instances = instances
    cfg.parallel.expert_model_parallel_size = 2
    optimizer = build_optimizer(cfg, [model], state)
    sizes = set()
    for bucket in model.buckets:
        expert = not getattr(bucket.params[0], "allreduce", True)
        shard = torch.distributed.get_world_size(bucket.group) if bucket.group is not None else 1
        replicas = torch.distributed.get_world_size(bucket.replicate_group) if bucket.replicate_group else 1
        sizes.add((expert, shard, replicas))
        start, end = bucket.shard()
        assert end - start == bucket.numel // shard
    # expert-DP 2 / instances; DP 4 / instances; each replicated over the instances
    assert sizes == {(True, 2 // instances, instances), (False, 4 // instances, instances)}, sizes

    model.zero_grad_buffer()
    _loss(model, x[state.dp_rank::4], y[state.dp_rank::4]).backward()
    finalize_model_grads([model], state)
    expected, norm = _reference(state, x, y)
    names = {id(p): n for n, p in model.module.named_parameters()}
    owned = {}
    for piece in optimizer.pieces:
        name = names[id(piece.param)]
        want = expected[name].reshape(-1)[piece.lo : piece.hi]
        torch.testing.assert_close(piece.grad(), want, rtol=1e-5, atol=1e-7)
        owned.setdefault(name, []).append((piece.lo, piece.hi))
    torch.testing.assert_close(optimizer._grad_norm(), norm, rtol=1e-5, atol=0)
    # the memory model: dense state over 4 / N ranks, expert state over 2 / N (no bucket needs padding)
    optimizer.step()  # Adam's moments exist from the first step on
    got = measured_model_state_bytes([model], optimizer)
    device, host = formula_model_state_bytes(cfg, [model], 4)
    assert (got["params"] + got["grads"] + got["optimizer"], got["optimizer_cpu"]) == (device, host), got
    full, sharded = {"optim": (8, 12), "optim_grads": (4, 16), "optim_grads_params": (0, 20)}[strategy]
    assert device == 44 * full + 28 * Fraction(sharded * instances, 4) + 16 * Fraction(sharded * instances, 2)
    return owned


def _covered_once(ranges, numel):
    """The flat ranges [lo, hi) tile [0, numel): no gap, no overlap."""
    ranges = sorted(ranges)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel, ranges
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges


@pytest.mark.parametrize("instances, strategy", [(1, "optim"), (2, "optim"), (2, "optim_grads"),
                                                (2, "optim_grads_params")])
def test_expert_buckets_shard_within_an_instance(instances, strategy):
    owned = run_ranks(4, check_expert_shards, instances, strategy)  # rank = ep + 2 x edp
    blocks = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]]}[instances]  # the ranks of each instance
    for ranks in blocks:  # inside one instance every element is owned by exactly one rank
        _covered_once([r for rank in ranks for r in owned[rank].get("dense.weight", [])], OUT * IN)
        for ep_rank in (0, 1):  # one EP rank's expert: its expert-DP ranks in this instance
            _covered_once([r for rank in ranks if rank % 2 == ep_rank for r in owned[rank].get("expert", [])],
                          OUT * OUT)
