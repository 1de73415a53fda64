"""ZeRO-2/3 gradients: each rank's gradient shard is its slice of the single-process gradient.

``optim_grads`` (ZeRO-2) and ``optim_grads_params`` (ZeRO-3) keep, per bucket, only this rank's
chunk of the averaged fp32 gradient (``bucket.grad_shard``). At DP 2 and DP 4, each rank runs two
micro-batches of its own data (the first inside ``no_sync``, as the pipeline schedules do; sharded
gradients are reduce-scattered after every backward anyway) and ``finalize_model_grads``. The
reference is the single-process model of the same initial weights back-propagating the mean loss
over every rank's micro-batches. Every bucket's shard must equal the slice ``[start, end)`` that
this rank owns of the reference gradients laid out as the bucket lays them out (padding zero),
fp32 rtol 1e-6; the optimizer's gradient norm must equal the reference's. The toy head has 27
parameters, so its bucket is padded at DP 2 and DP 4.

Hybrid sharding (HSDP, ``--num-distributed-optimizer-instances 2`` at DP 4): every bucket (and, ZeRO-3,
its parameter shard) is cut over the 2 ranks of this rank's instance and replicated over the 2
instances, the shard is still this rank's slice of the reference, and the instances' all-reduce of
the shards runs once for the step (its bytes are those of one all-reduce of every shard), not once
per micro-batch.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.config import Config
from megatron_lite.optim import build_optimizer
from megatron_lite.parallel import comm
from megatron_lite.parallel.data_parallel import finalize_model_grads
from megatron_lite.parallel.fsdp import wrap_for_data_parallel
from megatron_lite.perf.comm_volume import CommVolume, ring_bytes
from tests.distributed.test_fsdp import _Block
from tests.harness import cached_state, run_ranks

MICRO_BATCHES = 2


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 3)  # 27 parameters: padded buckets at DP 2 and 4

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(dp_rank: int, i: int):
    g = torch.Generator().manual_seed(100 * dp_rank + i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _reference(dp: int) -> dict[str, torch.Tensor]:
    ref = _Toy()
    for d in range(dp):
        for i in range(MICRO_BATCHES):
            (_loss(ref, *_batch(d, i)) / (dp * MICRO_BATCHES)).backward()
    return {name: p.grad for name, p in ref.named_parameters()}


def check_shards(dp: int, strategy: str, instances: int = 1):
    state = cached_state(dp=dp, dist_opt_instances=instances)
    cfg = Config()
    cfg.parallel.data_parallel_sharding_strategy = strategy
    cfg.parallel.num_distributed_optimizer_instances = instances
    cfg.parallel.ddp_bucket_size = 20  # ZeRO-2: head (27, padded), block 1, block 0; ZeRO-3: one per unit
    model = wrap_for_data_parallel(_Toy(), state, cfg.parallel)
    optimizer = build_optimizer(cfg, [model], state)
    _check_groups(model, state, dp // instances, instances)
    optimizer.zero_grad()
    volume = CommVolume()
    with volume.counting():
        for i in range(MICRO_BATCHES):
            with model.no_sync() if i < MICRO_BATCHES - 1 else torch.enable_grad():
                (_loss(model, *_batch(state.dp_rank, i)) / MICRO_BATCHES).backward()
        finalize_model_grads([model], state)
    replicas = volume.end_step().get(("dp", "all_reduce"), 0)
    assert replicas == ring_bytes("all_reduce", 4 * model.grad_shards.numel(), instances), replicas

    ref = _reference(dp)
    name_of = {id(p): name for name, p in model.module.named_parameters()}
    assert len(model.buckets) >= 3 and any(b.numel > sum(p.numel() for p in b.params) for b in model.buckets)
    for bucket in model.buckets:
        full = torch.zeros(bucket.numel)
        for p in bucket.params:
            a, e = bucket.offsets[id(p)]
            full[a:e] = ref[name_of[id(p)]].reshape(-1)
        start, end = bucket.shard()
        names = [name_of[id(p)] for p in bucket.params]
        torch.testing.assert_close(bucket.grad_shard, full[start:end], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, names=names: f"shard of {names}: {m}")
    ok, norm = optimizer.step()
    ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in ref.values())).item()
    assert ok and abs(norm - ref_norm) <= 1e-6 * ref_norm, (norm, ref_norm)
    return True


def _check_groups(model, state, shard: int, instances: int) -> None:
    """Every bucket shards over this rank's instance (``shard`` consecutive ranks) and is replicated
    over ``instances`` ranks, one per instance; ZeRO-3 keeps a parameter shard of the same size."""
    block = state.rank // shard * shard
    for bucket in model.buckets:
        assert comm.group_size(bucket.group) == shard and comm.group_size(bucket.replicate_group) == instances
        members = dist.get_process_group_ranks(bucket.group) if shard > 1 else [state.rank]
        assert members == list(range(block, block + shard)), members
        if instances > 1:
            assert dist.get_process_group_ranks(bucket.replicate_group) == list(range(state.rank % shard, 4, shard))
        assert bucket.numel % shard == 0 and bucket.grad_shard.numel() == bucket.numel // shard
        if model.strategy == "optim_grads_params":
            assert bucket.param_shard.numel() == bucket.numel // shard


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("dp, instances", [(2, 1), (4, 1), (4, 2)], ids=["dp2", "dp4", "dp4_hybrid2"])
def test_gradient_shards_are_slices_of_the_single_process_gradient(dp, instances, strategy):
    assert all(run_ranks(dp, check_shards, dp, strategy, instances))
