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
"""

import pytest
import torch
from torch import nn

from megatron_lite.config import Config
from megatron_lite.optim import build_optimizer
from megatron_lite.parallel.data_parallel import finalize_model_grads
from megatron_lite.parallel.fsdp import wrap_for_data_parallel
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


def check_shards(dp: int, strategy: str):
    state = cached_state(dp=dp)
    cfg = Config()
    cfg.parallel.data_parallel_sharding_strategy = strategy
    cfg.parallel.ddp_bucket_size = 20  # ZeRO-2: head (27, padded), block 1, block 0; ZeRO-3: one per unit
    model = wrap_for_data_parallel(_Toy(), state, cfg.parallel)
    optimizer = build_optimizer(cfg, [model], state)
    optimizer.zero_grad()
    for i in range(MICRO_BATCHES):
        with model.no_sync() if i < MICRO_BATCHES - 1 else torch.enable_grad():
            (_loss(model, *_batch(state.dp_rank, i)) / MICRO_BATCHES).backward()
    finalize_model_grads([model], state)

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


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("dp", [2, 4])
def test_gradient_shards_are_slices_of_the_single_process_gradient(dp, strategy):
    assert all(run_ranks(dp, check_shards, dp, strategy))
