"""The sharded checkpoint format (``--ckpt-format torch_dist``): every rank writes only what it owns,
and a checkpoint loads at any TP x PP x DP layout.

What each rank owns (nothing is gathered, nothing written twice):

* **weights**: its tensor-parallel shard of every tensor of its pipeline stage, written by the
  ranks of data-parallel (and context-parallel) rank 0; tensors replicated over TP by TP rank 0 only.
* **optimizer state** (fp32 masters when separate from the weights, Adam's moments or SGD's momentum):
  with ``--use-distributed-optimizer`` each data-parallel rank writes the flat range of each shard its
  optimizer steps (cut into boxes, :func:`~megatron_lite.checkpoint.boxes.flat_boxes`); with the plain
  optimizer data-parallel rank 0 writes whole shards.

Experts (expert parallelism) are keyed by their global number, so the keys are the same at every EP
size: a sequential expert's local ``local_experts.{j}`` is saved as ``local_experts.{first + j}``,
the stacked grouped-GEMM weights as rows ``[first, first + E_local)`` of a global ``[E, ...]``
tensor. An expert tensor is written by expert-data-parallel rank 0 of its (TP, EP) position, its
distributed-optimizer slices by every expert-data-parallel rank.

The last stage's copy of the word embedding (a tied output layer's ``output_layer.weight``, or the
``embedding`` a multi-token-prediction stage holds) is not written (it equals the first stage's
embedding, state included); on load it is read from the embedding. Loading (:func:`load_dist`) works
out, for every tensor this rank needs, which saved boxes overlap it and reads only those
(:mod:`~megatron_lite.checkpoint.dist_read`), so a checkpoint saved at TP2 x DP2 with the distributed
optimizer resumes at TP1 x DP4 or PP2 with the same weights and optimizer state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..device import get_device
from ..optim.distrib_optimizer import DistributedOptimizer
from ..precision.fp8 import is_fp8_state_key
from .boxes import canonical_shape, extent, flat_boxes, shard_offset
from .dist_read import fill, key_of, read_index
from .format import VOCAB_TENSORS, CheckpointError, check_optimizer_name, restore_scheduler, saved_config
from .frozen import base_of, is_frozen, other_history_length, unwrap
from .layout import expert_place
from .router_bias import is_router_bias, refuse_optimizer, say_filled

STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",),
              "muon": ("exp_avg", "exp_avg_sq", "momentum_buffer")}  # Muon: AdamW's for the non-matrices
WORD_EMBEDDING = "embedding.word_embeddings.weight"
_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")


@dataclass
class RankTensor:
    """One tensor of this rank (a parameter or buffer) placed in its global canonical tensor."""

    name: str  # global name (layers numbered globally; the tied copy named as the embedding)
    value: torch.Tensor
    dim: int | None  # tensor-parallel partition dim, None when replicated over TP
    local: tuple  # local canonical shape
    offset: tuple  # global canonical offset
    global_shape: tuple
    owned: bool  # this rank's TP position writes it (TP rank 0 for replicated tensors; never the tied copy)
    expert: bool = False  # an expert's tensor: replicated over expert-DP (not DP), one per expert-parallel rank
    frozen: bool = False  # a frozen parameter (LoRA base): not saved, it comes from the base (frozen.py)


def _global(name: str, start: int) -> str:
    m = _LAYER.match(name)
    return f"{m.group(1)}.layers.{start + int(m.group(2))}.{m.group(3)}" if m else name


def _first_experts(module) -> dict[str, int]:
    """{name prefix of an experts module: global index of its first local expert}."""
    return {f"{name}.": int(m.first_expert) for name, m in module.named_modules()
            if hasattr(m, "first_expert") and hasattr(m, "num_local_experts")}


def rank_tensors(chunks, state) -> tuple[list[RankTensor], dict[int, RankTensor]]:
    """This rank's tensors, and the same by ``id`` of each parameter (for the optimizer's slots).
    Experts are named and placed by their global index (:func:`~megatron_lite.checkpoint.layout.expert_place`),
    so the same expert has the same key at every expert-parallel size."""
    out, by_param = [], {}
    for chunk in chunks:
        module = unwrap(chunk)
        holder = module if hasattr(module, "layer_start") else getattr(module, "decoder", module)
        start = int(getattr(holder, "layer_start", 0) or 0)
        params = {id(p) for p in module.parameters()}
        copy = not getattr(module, "pre_process", True)  # a later stage's copy of the word embedding
        tied_copy = copy and getattr(module, "tied", False)
        firsts = _first_experts(module)
        for name, value in module.state_dict(keep_vars=True).items():
            if not torch.is_tensor(value):
                continue
            is_tp = id(value) in params and getattr(value, "tensor_model_parallel", False)
            dim = int(value.partition_dim) if is_tp else None
            stride = int(getattr(value, "partition_stride", 1)) if is_tp else 1
            local = canonical_shape(value.shape, dim, stride)
            name, row, expert = expert_place(name, firsts, state.ep_size)
            # a folded expert grid splits the experts over its own ETP group (megatron_lite/parallel/expert_grid.py)
            split_rank, split = (state.etp_rank, state.etp_size) if expert and state.folded else (state.tp_rank, state.tp_size)
            offset = shard_offset(local, dim, split_rank)
            global_shape = tuple(x * split if dim is not None and i == dim + 1 else x for i, x in enumerate(local))
            if row is not None:  # stacked grouped-expert tensor: dim 0 is the global expert axis
                offset = (offset[0] + row,) + offset[1:]
                global_shape = (global_shape[0] * state.ep_size,) + global_shape[1:]
            alias = (tied_copy and name == "output_layer.weight") or (copy and name == WORD_EMBEDDING)
            tensor = RankTensor(WORD_EMBEDDING if alias else _global(name, start), value, dim, local, offset,
                                global_shape, not alias and (dim is not None or split_rank == 0), expert,
                                is_frozen(value))
            out.append(tensor)
            by_param[id(value)] = tensor
    return out, by_param


def _slot_boxes(tensor: RankTensor, lo: int, hi: int):
    """(global offset, sizes, start) of the flat range ``[lo, hi)`` of ``tensor``'s shard."""
    return [(tuple(o + b for o, b in zip(off, tensor.offset)), size, start)
            for off, size, start in flat_boxes(tensor.local, lo, hi)]


def _state_keys_of(optimizer, master) -> tuple:
    """The per-element state keys of one slot (Muon's: Adam's or the momentum buffer, per tensor)."""
    keys_of = getattr(optimizer.optimizer, "state_keys_of", None)
    return keys_of(master) if keys_of is not None else STATE_KEYS[optimizer.config.optimizer]


def _slot_sources(optimizer, param, master) -> dict:
    """{kind: tensor} of one optimizer slot: the master when separate, and the optimizer's state."""
    sources = {} if master is param else {"master": master}
    state = optimizer.optimizer.state.get(master, {})
    for key in STATE_KEYS[optimizer.config.optimizer]:
        if key in state:
            sources[key] = state[key]
    return sources


def rank_pieces(chunks, optimizer, state) -> dict[str, torch.Tensor]:
    """``{DCP key: tensor}`` of everything this rank writes (views of the live tensors)."""
    tensors, by_param = rank_tensors(chunks, state)
    dense_writer = state.dp_rank == 0 and state.cp_rank == 0
    # each EP rank writes its own experts (a folded grid's expert-DP group holds CP: its rank 0 writes)
    expert_writer = state.expert_dp_rank == 0 and (state.cp_rank == 0 or state.folded)
    sharded = isinstance(optimizer, DistributedOptimizer)  # every (expert-)DP rank writes its own slice
    pieces = {}
    for t in tensors:
        if t.owned and not t.frozen and (expert_writer if t.expert else dense_writer):
            pieces[key_of("weight", t.name, t.offset)] = t.value.detach().view(t.local)
    if optimizer is None:
        return pieces
    for param, master, lo, hi in optimizer.shard_slots():
        t = by_param[id(param)]
        if not t.owned or not (sharded or (expert_writer if t.expert else dense_writer)):
            continue
        for kind, value in _slot_sources(optimizer, param, master).items():
            flat = value.detach().reshape(-1)
            for offset, size, start in _slot_boxes(t, lo, hi):
                n = 1
                for s in size:
                    n *= s
                pieces[key_of(kind, t.name, offset)] = flat[start:start + n].view(size)
    return pieces


def _agree_max(value: float) -> float:
    """The largest ``value`` over all ranks (collective)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = torch.tensor([float(value)], dtype=torch.float64, device=get_device())
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return float(box.item())
    return float(value)


def _partition_table(chunks, state) -> dict:
    """{global name: partition dim} of the TP-split tensors of every rank (collective)."""
    mine = {t.name: t.dim for t in rank_tensors(chunks, state)[0] if t.dim is not None}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        for table in every:
            mine.update(table)
    return mine


def optimizer_common(optimizer, config) -> dict | None:
    """What the optimizer keeps besides its per-element state: step, hyper-parameters, loss scaler (collective)."""
    if optimizer is None:
        return None
    steps = [float(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s]
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k not in ("params", "weight_decay")}
    return {
        "name": config.optim.optimizer, "step": int(_agree_max(max(steps, default=0.0))), "hyper": hyper,
        "weight_decay": config.optim.weight_decay, "state_keys": STATE_KEYS[config.optim.optimizer],
        "loss_scaler": optimizer.scaler.state_dict() if optimizer.scaler is not None else None,
        "num_skipped_steps": optimizer.num_skipped_steps,
    }


def layout_of(state) -> dict:
    folded = {"etp": state.etp_size} if getattr(state, "folded", False) else {}  # a folded expert grid's ETP
    return {"tp": state.tp_size, "pp": state.pp_size, "dp": state.dp_size, "cp": state.cp_size,
            "ep": state.ep_size, "vpp": state.vpp_size, "world_size": state.world_size, **folded}


def common_payload(iteration, consumed, chunks, optimizer, scheduler, config, state, consumed_valid=None) -> dict:
    """The contents of ``common.pt`` (collective: the partition table and the step are agreed)."""
    return {
        "format": "torch_dist", "iteration": int(iteration), "consumed_samples": int(consumed),
        "consumed_valid_samples": consumed_valid,
        "config": saved_config(config), "layout": layout_of(state), "partition": _partition_table(chunks, state),
        "optimizer": optimizer_common(optimizer, config), "frozen_base": base_of(chunks),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
    }


# ---------------------------------------------------------------------------------------------
# Load.


def _loose(tensors, vocab_size: int) -> dict:
    """{name: (canonical axis, real rows)} where saved and needed sizes may differ: the vocabulary,
    padded for the TP size (re-padded on load: ``vocab_size`` real rows, zero padded rows)."""
    return {t.name: (t.dim + 1 if t.dim is not None else 0, vocab_size) for t in tensors if t.name in VOCAB_TENSORS}


def load_weights(folder, index, tensors, vocab_size: int) -> None:
    requests = [("weight", t.name, t.value.detach().view(t.local), t.offset, t.global_shape) for t in tensors]
    fill(folder, index, requests, _loose(tensors, vocab_size))


def load_optimizer(folder, index, common, optimizer, tensors, by_param) -> None:
    """Each slot of ``optimizer`` from the saved boxes: masters (from the weights when none were
    saved), moments, step, hyper-parameters, loss scaler, skip count."""
    opt = common["optimizer"]
    check_optimizer_name(folder, opt["name"], optimizer.config.optimizer)
    kinds = {k for k, _ in index}
    keys = [k for k in opt["state_keys"] if k in kinds]
    slots = optimizer.shard_slots()
    with torch.no_grad():
        for _param, master, _, _ in slots:
            mine = [k for k in keys if k in _state_keys_of(optimizer, master)]
            if mine:
                entry = {k: torch.zeros_like(master, dtype=getattr(optimizer, "moment_dtypes", {}).get(k, master.dtype))
                         for k in mine}  # the run's moment dtype: a saved fp32 / bf16 moment is cast on read
                if "exp_avg" in entry:  # Adam's (also Muon's AdamW part)
                    entry["step"] = torch.tensor(float(opt["step"]))
                optimizer.optimizer.state[master] = entry
            else:
                optimizer.optimizer.state.pop(master, None)
    for kind in ["master"] + keys:
        requests = []
        for param, master, lo, hi in slots:
            if kind == "master" and master is param:
                continue  # fp32 weights stepped in place: already loaded
            if kind != "master" and kind not in optimizer.optimizer.state.get(master, {}):
                continue  # Muon: a matrix has no Adam moments, the rest no momentum buffer
            t = by_param[id(param)]
            flat = (master if kind == "master" else optimizer.optimizer.state[master][kind]).view(-1)
            source = kind if kind != "master" or "master" in kinds else "weight"
            for offset, size, start in _slot_boxes(t, lo, hi):
                n = 1
                for s in size:
                    n *= s
                requests.append((source, t.name, flat[start:start + n].view(size), offset, t.global_shape))
        fill(folder, index, requests, _loose(tensors, common["config"].get("vocab_size")))
    optimizer.note_saved_hyper(opt["hyper"])
    if optimizer.scaler is not None and opt["loss_scaler"] is not None:
        optimizer.scaler.load_state_dict(opt["loss_scaler"])
    optimizer.num_skipped_steps = int(opt["num_skipped_steps"])


def _saved_shape(index, name: str) -> tuple | None:
    """The canonical shape of the weight ``name`` in the checkpoint (None: not saved)."""
    boxes = index.get(("weight", name))
    return extent((o, s) for o, s, _, _ in boxes) if boxes else None


def load_dist(folder: str, common: dict, chunks, optimizer, scheduler, state, load_optim: bool) -> None:
    """Load this rank's weights (and, with ``load_optim``, optimizer state and schedule) from the
    torch_dist checkpoint in iteration ``folder`` (``common``: its ``common.pt``); local, no collectives.
    Without ``load_optim`` the caller refreshes the fp32 masters once the weights are in place."""
    index = read_index(folder)
    tensors, by_param = rank_tensors(chunks, state)
    fresh_fp8 = not any(is_fp8_state_key(name) for kind, name in index if kind == "weight")  # saved without FP8
    filled = zero_absent_router_biases(tensors, index, folder)
    fresh = {t.name for t in tensors if (fresh_fp8 and is_fp8_state_key(t.name))  # these stay as built
             or other_history_length(t.name, _saved_shape(index, t.name), t.global_shape)}
    load_weights(folder, index, [t for t in tensors if not t.frozen  # frozen ones: from the base, loaded before
                                 and t.name not in fresh and t.name not in filled],
                 common["config"].get("vocab_size"))
    if load_optim and optimizer is not None:
        if common["optimizer"] is None:
            raise CheckpointError(f"checkpoint {folder} has no optimizer state; pass --no-load-optim or --finetune")
        if filled:
            refuse_optimizer(folder)
        load_optimizer(folder, index, common, optimizer, tensors, by_param)
        if scheduler is not None and common["scheduler"] is not None:
            restore_scheduler(scheduler, common["scheduler"], folder)


def zero_absent_router_biases(tensors, index, folder: str) -> set[str]:
    """The names of this rank's MoE router biases the torch_dist checkpoint lacks (saved before the router
    had one), set to zero here (:mod:`.router_bias`)."""
    filled = {t.name for t in tensors if is_router_bias(t.name) and ("weight", t.name) not in index}
    with torch.no_grad():
        for t in tensors:
            if t.name in filled:
                t.value.detach().zero_()
    say_filled(folder, filled)
    return filled


def is_fresh_layout(common: dict, state) -> bool:
    """True when the checkpoint was saved at another layout than this run's (RNG states do not carry)."""
    return common["layout"] != layout_of(state)
