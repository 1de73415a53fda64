"""``--check-weight-hash-across-dp-replicas-interval N``: every data-parallel replica holds the same
weights (Megatron-LM's check, before the first step and after every N-th).

Each rank hashes each of its parameters (a bit-exact checksum: the parameter's bits read as integers,
their sum and their sum of squares, in int64 that wraps), all-gathers the hashes over the ranks
that hold the same copy, and compares: dense parameters over the data-parallel x context-parallel
group, expert parameters over the expert-data-parallel group. Only replicated weights are compared:
the model's parameters are whole replicas under the distributed optimizer (ZeRO-1/2), whose sharded
fp32 masters and moments legitimately differ per rank and are left out; under ZeRO-3 every rank holds
another shard of the parameters, so the check is refused (``rerun_flags.py``).

A mismatch anywhere stops every rank in one line naming the ranks that differ and the first parameter,
exit code 1 (Megatron-LM's failed assertion).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..console import print_rank_0
from ..device import get_device
from ..parallel.comm import group_size
from .rerun import StopEveryRank

SLICE = 1 << 24  # elements hashed at a time: the int64 copy stays small for a large embedding
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class WeightHashMismatchError(StopEveryRank):
    """Data-parallel replicas hold different weights; every rank raises it together."""

    exit_code = 1  # Megatron-LM asserts: a failed assertion exits 1


def tensor_hash(t: torch.Tensor) -> torch.Tensor:
    """Two int64s of ``t``'s bits (sum and sum of squares of its elements read as integers): equal
    bits give equal hashes on every rank; any changed element changes them almost surely."""
    flat = t.detach().contiguous().view(-1)
    ints = flat.view(INT_OF_SIZE[flat.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, ints.numel(), SLICE):
        part = ints[start:start + SLICE].long()
        out[0] += part.sum()
        out[1] += (part * part).sum()
    return out


def _named_params(chunks) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, parameter, is an expert's replicated over expert-DP only) of every chunk, frozen ones too."""
    return [(f"chunk{i}.{name}" if len(chunks) > 1 else name, p, not getattr(p, "allreduce", True))
            for i, chunk in enumerate(chunks) for name, p in chunk.module.named_parameters()]


def _mismatch(hashes: torch.Tensor, names: list[str], group) -> str | None:
    """Over one group: which ranks differ from the majority, and in which parameter first; or None."""
    size = group_size(group)  # None: a group of one rank (not the world)
    if size == 1 or not names:
        return None
    parts = [torch.empty_like(hashes) for _ in range(size)]
    dist.all_gather(parts, hashes, group=group)
    gathered = torch.stack(parts).cpu()
    rows = [tuple(r.reshape(-1).tolist()) for r in gathered]
    majority = max(set(rows), key=rows.count)
    bad = [i for i, r in enumerate(rows) if r != majority]
    if not bad:
        return None
    ranks = dist.get_process_group_ranks(group)
    good = rows.index(majority)
    first = next(j for j in range(len(names)) if (gathered[bad[0], j] != gathered[good, j]).any())
    which = f"rank {ranks[bad[0]]} differs" if len(bad) == 1 else f"ranks {', '.join(str(ranks[i]) for i in bad)} differ"
    return f"{which} from rank {ranks[good]}, first in {names[first]}"


def check_weight_hashes(chunks, state, iteration: int) -> None:
    """Compare every replicated parameter's hash over its data-parallel replicas; raise
    :class:`WeightHashMismatchError` on every rank when any group differs."""
    if not dist.is_initialized():
        return
    for chunk in chunks:  # --overlap-param-gather: the step's all-gathers land first
        chunk.finish_param_gather()
    params = _named_params(chunks)
    found = []
    for expert, group in ((False, state.dp_cp_group), (True, state.expert_dp_group)):
        picked = [(n, p) for n, p, e in params if e == expert]
        if picked:
            hashes = torch.stack([tensor_hash(p) for _, p in picked])
            found.append(_mismatch(hashes, [n for n, _ in picked], group))
        else:
            found.append(None)
    flag = torch.tensor([1.0 if any(found) else 0.0], device=get_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops together (other stages too)
    if flag.item() == 0:
        print_rank_0(f"> weight hashes match across data-parallel replicas after {iteration} iterations")
        return
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, "; ".join(f for f in found if f))
    what = "; ".join(dict.fromkeys(line for line in lines if line))
    raise WeightHashMismatchError(
        f"after iteration {iteration} the data-parallel replicas' weights differ ({what}): a silent data "
        "corruption or a non-deterministic reduction on those ranks' hardware; stopping without saving, "
        "exit code 1; restart from the last checkpoint, leaving those ranks' GPUs out")
