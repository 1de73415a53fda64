"""Torch-format model files under a folded expert grid (megatron_lite/parallel/expert_grid.py).

A folded grid splits the experts over their own ETP x EP groups, so a rank's file holds its dense
shard (TP rank ``t``) and its expert shard (EP rank ``e``, expert-tensor rank ``x``): the folder is
``mp_rank_{t:02d}_{pp:03d}_{e:03d}_{x:02d}``, written by the lowest rank holding that pair of shards
(every dense shard and every expert shard is then in some file, and every rank finds its own).
Resuming needs the same expert sizes (tools/checkpoint/convert.py converts between them, and
--ckpt-format torch_dist reshards across them); :func:`merge_folded_chunk` glues the files back into
one process (dense layers over TP, experts over ETP then EP), :func:`folded_files` names the files a
layout writes.
"""

from __future__ import annotations

import math

from .format import CheckpointError, model_file


def is_expert_tensor(name: str) -> bool:
    """Whether a chunk tensor belongs to the routed experts (held by the expert shard of a folded file)."""
    return ".mlp.experts." in name


def folded_files(tp: int, ep: int, etp: int) -> list[tuple[int, int, int]]:
    """The ``(tp, ep, etp)`` ranks of every file a folded grid writes per pipeline stage: the pairs of
    a dense and an expert shard that some rank holds. A stage's ranks are a multiple of
    ``lcm(tp, etp * ep)`` and repeat the pairs of the first that many ranks, so the set holds for
    every data- and context-parallel size."""
    return sorted({(r % tp, r // etp % ep, r % etp) for r in range(math.lcm(tp, etp * ep))})


def model_file_for(root: str, iteration, state) -> str:
    """This rank's model file."""
    if not state.folded:
        return model_file(root, iteration, state.tp_rank, state.pp_rank, state.ep_rank if state.ep_size > 1 else None)
    return model_file(root, iteration, state.tp_rank, state.pp_rank, state.ep_rank, state.etp_rank)


def _shards(grid, rank: int) -> tuple[int, ...]:
    c = grid.coords(rank)
    return c["pp"], c["tp"], c["ep"], c["etp"]


def writes_model_file(state) -> bool:
    """Whether this rank writes its model file (one writer per file)."""
    if not state.folded:
        return state.expert_dp_rank == 0 and state.cp_rank == 0
    mine = _shards(state.grid, state.rank)
    return state.rank == min(r for r in range(state.world_size) if _shards(state.grid, r) == mine)


def expert_grid_fields(state) -> dict:
    """What a model file records about the experts' grid."""
    return {"etp_size": state.etp_size, "expert_grid_folded": bool(state.folded)}


_SIZES = (("tp_size", "tensor-model-parallel-size", "TP"), ("pp_size", "pipeline-model-parallel-size", "PP"),
          ("ep_size", "expert-model-parallel-size", "EP"), ("etp_size", "expert-tensor-parallel-size", "ETP"))


def check_expert_grid(path: str, ckpt: dict, state) -> None:
    """A torch-format checkpoint of a folded grid resumes only at its own sizes, and a folded run
    loads only such a checkpoint: one CheckpointError naming the saved and this run's sizes."""
    saved_folded = bool(ckpt.get("expert_grid_folded", False))
    if not (saved_folded or state.folded):
        return
    g = state.grid
    ours = {"etp_size": g.expert_tp, "ep_size": g.ep, "tp_size": g.tp, "pp_size": g.pp}
    saved = {key: ckpt.get(key, 1) for key in ours}
    saved["etp_size"] = ckpt.get("etp_size", saved["tp_size"])
    if saved_folded == bool(state.folded) and saved == ours:
        return
    differ = [f"--{flag} {saved[key]}" for key, flag, _ in _SIZES if saved[key] != ours[key]]
    fix = (f"set {', '.join(differ)}" if differ else "launch the saved data- and context-parallel sizes (the "
           "experts fold where --expert-model-parallel-size does not divide the data-parallel size)")
    # convert.py folds the experts only when told the data-parallel size EP does not divide
    convert_dp = f" with --target-data-parallel-size {g.dp}" if state.folded else ""
    raise CheckpointError(
        f"checkpoint {path} was saved at {_grid(saved, saved_folded)}, this run has "
        f"{_grid(ours, state.folded)}; a --ckpt-format torch checkpoint of a folded expert grid resumes only at "
        f"its own sizes: {fix}, convert it to this run's sizes (tools/checkpoint/convert.py{convert_dp}), or save with "
        "--ckpt-format torch_dist (it reshards the experts on --load)")


def _grid(sizes: dict, folded) -> str:
    return ", ".join(f"{short} {sizes[key]}" for key, _, short in _SIZES) + f" ({'' if folded else 'un'}folded expert grid)"


def merge_folded_chunk(path: str, payloads: dict, pp_rank: int, chunk: int, merge_tp, merge_ep) -> dict:
    """Chunk ``chunk`` of pipeline rank ``pp_rank`` from ``{(tp, pp, ep, etp): payload}``: dense
    tensors glued over TP, expert tensors over ETP, then the experts of every EP rank merged."""
    first = next(v for k, v in sorted(payloads.items()) if k[1] == pp_rank)
    tp, ep, etp = first["tp_size"], first.get("ep_size", 1), first["etp_size"]

    def pick(**want):
        for key, payload in sorted(payloads.items()):
            if all(key[{"tp": 0, "pp": 1, "ep": 2, "etp": 3}[k]] == v for k, v in want.items()):
                return payload
        raise CheckpointError(f"{path}: no mp_rank file holds {want} of the folded expert grid (tp {tp} x ep {ep} "
                              f"x etp {etp}); the checkpoint is incomplete")

    dense = merge_tp([pick(tp=t, pp=pp_rank) for t in range(tp)], chunk)
    per_ep = []
    for e in range(ep):
        experts = merge_tp([pick(pp=pp_rank, ep=e, etp=x) for x in range(etp)], chunk)
        per_ep.append({name: experts[name] if is_expert_tensor(name) else dense[name] for name in dense})
    return merge_ep(per_ep)
