"""LoRA dropout under tensor parallelism draws from the right random stream.

A row-parallel base's adapter sees this rank's slice of the input features: each TP rank must drop
its own, independent entries (the tensor-parallel stream of the RNG tracker). A column-parallel
base's adapter sees the whole input, the same on every TP rank: every rank must drop the same
entries (the default stream), or the ranks' partial outputs would not belong to one forward.
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_lite.lora.adapters import LinearAdapter
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from tests.harness import cached_state, run_ranks


def _masks_on_every_rank():
    state = cached_state(tp=2)
    model_parallel_seed(1234, state)
    config, lora = SimpleNamespace(seed=1234), SimpleNamespace(lora_alpha=8, lora_rank=4, lora_dropout=0.5)
    same = {}
    for kind, base, width in (("row", RowParallelLinear(16, 8, state.tp_group), 8),
                              ("column", ColumnParallelLinear(16, 8, state.tp_group), 16)):
        adapter = LinearAdapter(base, kind, config, lora, 1, f"probe.{kind}", state.rng_tracker).train()
        same[kind] = same_mask_over(adapter, width, state.tp_group)
    return same


def same_mask_over(adapter, width: int, group) -> bool:
    """Whether ``adapter``'s dropout mask on a ``[64, width]`` input is the same on both ranks of
    ``group`` (checking that dropout really ran)."""
    mask = (adapter._dropout(torch.ones(64, width)) != 0).float()
    masks = [torch.empty_like(mask) for _ in range(2)]
    dist.all_gather(masks, mask, group=group)
    assert 0.2 < mask.mean() < 0.8  # dropout really ran
    return torch.equal(masks[0], masks[1])


def test_row_adapters_drop_independently_per_tp_rank_and_column_adapters_alike():
    for same in run_ranks(2, _masks_on_every_rank):
        assert same == {"row": False, "column": True}
