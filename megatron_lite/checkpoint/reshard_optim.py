"""Resharding the optimizer state with the weights, so a converted checkpoint resumes exactly.

Every model file stores the optimizer in one format (the distributed optimizer gathers into it):
``{"optimizer": torch state dict, "fp32_masters": [...] or None, "loss_scaler", "num_skipped_steps"}``.
The torch state dict numbers this rank's parameters in a fixed order: the model parameters of all
its chunks (``chunk.parameters()`` order), matrices first, then 1-D tensors (the weight-decay group,
then the no-decay group); ``fp32_masters`` follows the plain parameter order. Each state tensor
(Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``, the fp32 master) has its
parameter's shape and is split over TP exactly like it.

So the layout-free form is ``{global parameter name: full tensor}`` per state key, obtained with the
same ``param_meta`` and :func:`~megatron_lite.parallel.tensor.unshard` as the weights, and written
back per target rank with :func:`~megatron_lite.parallel.tensor.shard`, in the target's order.
Parameter names and order come from the chunk models built on the ``meta`` device at EP 1. An
expert-parallel rank's file holds the state of its own experts only, at the positions its model
puts them: its order is the EP-1 order without the other ranks' experts, and stacked grouped-GEMM
expert state is its slice of the ``[E, ...]`` tensor (joined back by concatenation when merging).
"""

from __future__ import annotations

import torch

from ..optim.optimizer import decays
from ..parallel.tensor import shard, unshard
from .expert_files import is_expert_tensor
from .format import CheckpointError, find_model_files, param_meta, read_model_file
from .layout import ep_name, ep_slice, global_name, is_grouped_expert


def param_order(chunks: list, ep_rank: int = 0, ep_size: int = 1, experts: int = 0,
                legacy: bool = False) -> tuple[list, list, dict, int]:
    """(names in ``parameters()`` order, names in the torch state's index order, chunk-local param_meta
    by global name, number of matrices: the weight-decay group) of one rank's chunk models (``(EP-1 meta model, layer_start)`` pairs), keeping the
    experts of EP rank ``ep_rank`` only (names stay global: expert numbers too). ``legacy``: the groups of
    checkpoints saved while every param of more than one dimension decayed (stacked expert biases too)."""
    plain, decay, meta = [], {}, {}
    for model, start in chunks:
        local_meta = param_meta(model)
        for name, p in model.named_parameters():
            if ep_name(name, ep_rank, ep_size, experts) is None:
                continue
            g = global_name(name, start)
            plain.append(g)
            decay[g] = p.dim() > 1 if legacy else decays(p)
            if name in local_meta:
                meta[g] = local_meta[name]
    indexed = [n for n in plain if decay[n]] + [n for n in plain if not decay[n]]
    return plain, indexed, meta, sum(decay.values())


def _join_ep(parts: dict) -> dict:
    """{name: [tensor of each EP rank that holds it]} -> {name: full tensor}: grouped expert weights
    are concatenated over the EP ranks, everything else is the first (only, or identical) copy."""
    return {name: torch.cat(ts) if is_grouped_expert(name) and len(ts) > 1 else ts[0] for name, ts in parts.items()}


def _saved_order(chunks, e, ep, experts, opt) -> tuple:
    """:func:`param_order` of EP rank ``e``'s file, in the groups its optimizer was saved with."""
    order = param_order(chunks, e, ep, experts)
    saved_decay = len(opt["optimizer"]["param_groups"][0]["params"])
    if saved_decay != order[3] and saved_decay == param_order(chunks, e, ep, experts, legacy=True)[3]:
        return param_order(chunks, e, ep, experts, legacy=True)
    return order


def _rank_files(payloads: dict, p: int, e: int, tp: int, etp: int | None) -> list:
    """``[(files to glue: [(EP rank, optimizer payload)], which names they give)]`` for pipeline rank
    ``p``, EP rank ``e`` of ``{(tp, pp, ep, etp): payload}``: its TP ranks' files (unfolded), or on a
    folded grid its experts from its ETP ranks' files and (once, with EP rank 0) the dense tensors
    from a file of each TP rank, whichever EP rank it holds."""
    if etp is None:
        return [([(e, payloads[(t, p, e, 0)]["optimizer"]) for t in range(tp)], None)]
    stage = sorted(((k, v["optimizer"]) for k, v in payloads.items() if k[1] == p), key=lambda item: item[0])
    by_etp = [next(((k[2], o) for k, o in stage if k[2] == e and k[3] == x), None) for x in range(etp)]
    by_tp = [next(((k[2], o) for k, o in stage if k[0] == t), None) for t in range(tp)]
    if None in by_tp + by_etp:
        raise CheckpointError(f"the folded expert grid's files of pipeline rank {p} miss a TP rank or an ETP rank of "
                              f"EP rank {e}; the checkpoint is incomplete")
    dense = [(by_tp, lambda name: not is_expert_tensor(name))] if e == 0 else []
    return dense + [(by_etp, is_expert_tensor)]


def _merge_rank(files: list, orders: list, tied, state, scalars, masters, keep=None) -> None:
    """Add the optimizer state of one (pipeline, expert) rank, glued over ``files`` (its TP or ETP
    ranks' optimizer payloads, each numbering its parameters in ``orders[i]`` = :func:`_saved_order`),
    to the per-name lists ``state[key][name]`` / ``masters[name]`` (``keep``: only the names it accepts)."""
    plain, indexed, meta, _ = orders[0]
    where = [{n: i for i, n in enumerate(order[1])} for order in orders]
    where_plain = [{n: i for i, n in enumerate(order[0])} for order in orders]

    def full(parts, name):
        m = meta.get(name)
        return parts[0] if m is None else unshard(parts, m["partition_dim"], m["partition_stride"])

    for name in indexed:
        if (name == "output_layer.weight" and tied) or (keep is not None and not keep(name)):
            continue  # the last stage's copy of the tied embedding: same state as the embedding
        entries = [o["optimizer"]["state"].get(w[name]) for o, w in zip(files, where)]
        if entries[0] is None:
            continue  # not stepped yet
        for key, value in entries[0].items():
            if torch.is_tensor(value) and value.dim() > 0:
                state.setdefault(key, {}).setdefault(name, []).append(full([e[key] for e in entries], name))
            else:
                scalars[key] = value
    if masters is not None:
        for name in plain:
            if not (name == "output_layer.weight" and tied) and (keep is None or keep(name)):
                parts = [o["fp32_masters"][w[name]] for o, w in zip(files, where_plain)]
                masters.setdefault(name, []).append(full(parts, name))


def merge_optimizer(path: str, chunk_models_of, tied: bool) -> dict | None:
    """The layout-free optimizer state of a checkpoint, or None when a file has none.

    ``chunk_models_of(pp_rank, payload)`` gives that rank's ``(EP-1 meta model, layer_start)`` pairs.
    Returns ``{"state": {key: {name: tensor}}, "scalars": {key: value}, "masters": {name: tensor} or
    None, "group": hyper-parameters, "weight_decay", "extra": loss scaler and skip count, "scheduler": ...}``
    (vocabulary tensors still padded as in the checkpoint). Expert ranks are joined like the weights.
    """
    files = find_model_files(path)
    payloads = {(key + (0, 0))[:4]: read_model_file(file) for key, file in files.items()}
    if any(p.get("optimizer") is None for p in payloads.values()):
        return None
    first = payloads[min(payloads)]
    tp, pp, ep = first["tp_size"], first["pp_size"], first.get("ep_size", 1)
    etp = first.get("etp_size", tp) if first.get("expert_grid_folded") else None
    experts = int(first["config"].get("num_experts") or 0)
    state: dict = {}
    scalars: dict = {}
    masters: dict | None = {} if first["optimizer"].get("fp32_masters") is not None else None
    for p in range(pp):
        chunks = chunk_models_of(p, payloads[min(k for k in payloads if k[1] == p)])
        for e in range(ep):
            for files, keep in _rank_files(payloads, p, e, tp, etp):
                orders = [_saved_order(chunks, r, ep, experts, opt) for r, opt in files]
                _merge_rank([opt for _, opt in files], orders, tied, state, scalars, masters, keep)
    groups = first["optimizer"]["optimizer"]["param_groups"]
    group = {k: v for k, v in groups[0].items() if k not in ("params", "weight_decay")}
    extra = {k: first["optimizer"].get(k) for k in ("loss_scaler", "num_skipped_steps")}
    return {"state": {key: _join_ep(table) for key, table in state.items()}, "scalars": scalars,
            "masters": None if masters is None else _join_ep(masters), "group": group, "extra": extra,
            "weight_decay": groups[0]["weight_decay"],  # the matrices' group comes first
            "scheduler": first.get("scheduler")}


def split_optimizer(optim: dict, chunks: list, tp_rank: int, tp: int, full_of, *, ep_rank: int = 0, ep_size: int = 1,
                    experts: int = 0, etp: tuple[int, int] | None = None) -> dict:
    """One target rank's optimizer payload. ``chunks``: its ``(EP-1 meta model, layer_start)`` pairs;
    ``full_of(name, tensor)`` maps a chunk's global name and a full layout-free tensor to the full
    tensor this layout needs (the tied copy, re-padded vocabulary); EP rank ``ep_rank`` keeps its experts,
    cut over ``etp`` = (ETP rank, ETP size) on a folded grid (over TP otherwise)."""
    plain, indexed, meta, matrices = param_order(chunks, ep_rank, ep_size, experts)

    def part(name, table):
        full = ep_slice(name, full_of(name, table), ep_rank, ep_size)
        m = meta.get(name)
        rank, size = etp if etp is not None and is_expert_tensor(name) else (tp_rank, tp)
        return (full if m is None else shard(full, m["partition_dim"], rank, size, m["partition_stride"])).clone()

    def holds(name, table):  # Muon's state: a matrix has only its momentum buffer, the rest only Adam's moments
        return name in table or (name == "output_layer.weight" and "embedding.word_embeddings.weight" in table)

    torch_state = {}
    for index, name in enumerate(indexed):
        if optim["state"]:
            entry = {key: part(name, table) for key, table in optim["state"].items() if holds(name, table)}
            if "momentum_buffer" not in entry:  # Adam's step count (SGD and Muon's matrices have none)
                entry.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in optim["scalars"].items()})
            torch_state[index] = entry
    groups = [dict(optim["group"], weight_decay=wd, params=ids)
              for wd, ids in ((optim["weight_decay"], list(range(matrices))), (0.0, list(range(matrices, len(indexed)))))
              if ids]
    masters = None if optim["masters"] is None else [part(name, optim["masters"]) for name in plain]
    return {"optimizer": {"state": torch_state, "param_groups": groups}, "fp32_masters": masters, **optim["extra"]}
