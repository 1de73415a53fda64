"""LoRA dropout on the experts of a folded expert grid draws from the expert stream of each
expert-tensor rank.

With --expert-tensor-parallel-size 2 at TP 1 (parallel folding) both ranks of an ETP group are TP
rank 0. fc2's adapter sees each rank's slice of the expert's hidden features, so the two ranks must
drop independent entries: the tracker's expert stream, seeded with the expert-tensor rank (Megatron's
``1024 + 100 * ep_rank + etp_rank``). fc1's adapter sees the gathered tokens, the same on both ranks,
and must drop the same entries (the default stream).
"""

from types import SimpleNamespace

import torch
from torch import nn

from megatron_lite.lora.experts import ExpertAdapter
from megatron_lite.parallel.random import model_parallel_seed
from tests.distributed.test_lora_dropout import same_mask_over
from tests.harness import cached_state, run_ranks


def _masks_on_every_rank():
    state = cached_state(etp=2)  # 2 ranks: attention DP 2, experts ETP 2 x EP 1
    assert state.folded and state.etp_size == 2 and state.tp_rank == 0
    model_parallel_seed(1234, state)
    experts = SimpleNamespace(etp_group=state.etp_group, _param=lambda data, dim: nn.Parameter(data))
    lora = SimpleNamespace(lora_alpha=8, lora_rank=4, lora_dropout=0.5)
    same = {}
    for fc, width in (("linear_fc2", 8), ("linear_fc1", 16)):
        a, b = torch.zeros(4, width), torch.zeros(16, 4)
        adapter = ExpertAdapter(experts, fc, a, b, (0, 0), 1, lora, 16, state.rng_tracker).train()
        same[fc] = same_mask_over(adapter, width, state.etp_group)
    return same


def test_folded_expert_row_adapters_drop_independently_per_etp_rank():
    for same in run_ranks(2, _masks_on_every_rank):
        assert same == {"linear_fc2": False, "linear_fc1": True}
