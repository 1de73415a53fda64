"""``--data-parallel-random-init`` (Megatron-LM's flag): each data-parallel rank seeds its random streams
with its own offset, ``seed + 100 x pipeline rank + 10 x data-parallel rank`` (the default stream, and the
tensor- and expert-parallel streams derived from it), so dropout masks differ between the replicas, and
anything a model provider draws from those streams differs too; before the data-parallel wrapper, every
parameter is then broadcast from the first data-parallel rank of its group (the dense ones over data x
context parallelism, the experts' over the expert-data-parallel group), so the replicas start from the
same weights, as gradient averaging needs. megatron_lite's own layers draw each weight from a generator
of its own (seed, layer, name), which is the same on every replica, so for them the broadcast changes
nothing; the checkpoint's per-rank RNG files keep each replica's streams across a resume.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def seed_offset(config, state) -> int:
    """What the flag adds to ``--seed`` on this rank (0 without it)."""
    return 10 * state.dp_rank if config.training.data_parallel_random_init else 0


def broadcast_from_first_replica(chunks, state) -> None:
    """Every parameter of ``chunks`` (unwrapped) set to the first data-parallel rank's values."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                group = state.dp_cp_group if getattr(param, "allreduce", True) else state.expert_dp_group
                if dist.get_world_size(group) > 1:
                    dist.broadcast(param.data, dist.get_global_rank(group, 0), group=group)
