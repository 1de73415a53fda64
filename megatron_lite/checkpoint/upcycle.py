"""``--moe-use-upcycling``: an MoE run started from a dense checkpoint (the rule: :mod:`megatron_lite.moe.upcycling`).

:func:`upcycles` decides, on the ``--load`` checkpoint's saved flags: a checkpoint without experts is
upcycled; one with experts (the upcycled run's own saves) is loaded as is, by the ordinary resume.
:func:`upcycle_here` merges the dense tensors of this rank's layers into single-process tensors (either
format, any TP x PP layout: :func:`~megatron_lite.checkpoint.pretrained.merge_for_rank`; with
``torch_dist`` only the experts' dense MLPs, the rest read from the boxes of this rank's shards),
derives each expert's full tensors from its layer's dense MLP on demand (grouped experts: only the
rank's rows), and cuts this rank's pieces out of them with the placement
``--pretrained-checkpoint`` uses (:func:`~megatron_lite.checkpoint.pretrained.cut_merged`): any TP, EP,
ETP and PP layout, sequential or grouped experts. Everything else (attention, norms, embeddings, the
dense layers of ``--moe-layer-freq``) is loaded as it is. The routers keep their fresh initialisation
(their rows shared within each copy of the dense MLP when the granularity is above 1).

As in Megatron-LM, the run starts at iteration 0 with a fresh optimizer and learning-rate schedule and
its own RNG states (like ``--finetune``). Megatron-LM also writes the upcycled model to ``--save``
(as iteration 1, without optimizer state) before the first step; here the run's saves are its ordinary
ones (``--save-interval``, and the end). Like Megatron-LM it refuses a ``--save`` that already holds a
checkpoint, whose iterations the upcycled run's saves would mix with.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..arch_flags import SHAPE_FLAGS
from ..console import print_rank_0
from ..moe.layer_pattern import parse_moe_layer_freq
from ..moe.upcycling import expert_from_dense, routing_mass, share_router_rows
from ..parallel.fsdp import full_params
from ..precision.fp8 import is_fp8_state_key
from .arch import arch_differences, check_family, saved_config
from .dist import load_weights, rank_tensors
from .dist_read import is_dist_folder, read_common, read_index
from .format import TRACKER_FILENAME, CheckpointError, read_tracker
from .layout import chunk_model
from .pretrained import checkpoint_folder, cut_merged, merge_for_rank

# the flags an upcycled model may set apart from its dense checkpoint (the experts' shapes)
MOE_SHAPE_FLAGS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
                   "moe_grouped_gemm", "moe_router_enable_expert_bias", "ffn_hidden_size")
_EXPERT = re.compile(r"^(.*\.)mlp\.experts\.(?:local_experts\.(\d+)\.linear_(fc[12]\.(?:weight|bias))"
                     r"|(weight1|weight2|bias1|bias2))$")
_STACKED = {"weight1": "fc1.weight", "weight2": "fc2.weight", "bias1": "fc1.bias", "bias2": "fc2.bias"}
_DENSE_MLP = re.compile(r"^(.*\.)mlp\.linear_fc[12]\.(?:weight|bias)$")
_FRESH = (".mlp.router.weight", ".mlp.router.bias", ".mlp.router.expert_bias")


def upcycles(config, root: str | None, iteration) -> bool:
    """Whether this load upcycles: ``--moe-use-upcycling`` and a ``--load`` checkpoint without experts.
    One CheckpointError when there is none to upcycle, or when ``--save`` already holds checkpoints."""
    if not config.moe.moe_use_upcycling:
        return False
    if iteration is None:
        raise CheckpointError(f"--moe-use-upcycling --load {root}: there is no checkpoint there (no {TRACKER_FILENAME}); "
                              "point --load at the dense checkpoint (the folder given to its --save)")
    folder, saved = saved_config(root)
    if saved.get("num_experts"):
        print_rank_0(f"--moe-use-upcycling: checkpoint {folder} already has experts; loading it as is (no upcycling)")
        return False
    save = config.checkpoint.save
    if save is not None and (latest := read_tracker(save)) is not None:
        raise CheckpointError(f"--moe-use-upcycling: --save {save} already holds a checkpoint (iteration {latest}), "
                              "which the upcycled run's saves would mix with; give an empty --save folder (later runs "
                              "resume the upcycled model with --load that folder, loaded as is)")
    return True


def _check_dense(folder: str, saved: dict, config) -> None:
    """The dense checkpoint's model flags must be this run's, but for the experts' (one CheckpointError)."""
    check_family(folder, saved, config)
    if saved.get("lora_rank"):
        raise CheckpointError(f"checkpoint {folder} holds LoRA adapters only; merge them into their base first "
                              "(tools/checkpoint/convert.py --load-dir it) and upcycle the merged checkpoint")
    diffs = arch_differences(saved, config, tuple(f for f in SHAPE_FLAGS if f not in MOE_SHAPE_FLAGS), shapes_only=True)
    if diffs:
        raise CheckpointError(f"--moe-use-upcycling: the dense checkpoint {folder} was saved with {', '.join(diffs)}; "
                              "match its model flags (only the MoE flags are this run's own)")
    dense_ffn, ffn = saved.get("ffn_hidden_size"), config.model.ffn_hidden_size
    if not all(parse_moe_layer_freq(config.moe.moe_layer_freq, config.model.num_layers)) and \
            dense_ffn not in (None, ffn):
        raise CheckpointError(f"--ffn-hidden-size {ffn}: the dense layers (--moe-layer-freq) keep the MLPs of checkpoint "
                              f"{folder}, {dense_ffn} wide; set --ffn-hidden-size {dense_ffn} (the experts' width is "
                              "--moe-ffn-hidden-size)")


class _Upcycled:
    """The MoE model's single-process tensors by global name, made from the dense ``merged`` ones on
    demand (``in`` and ``[]``, as :func:`cut_merged` reads them)."""

    def __init__(self, folder: str, merged: dict, moe):
        self.folder, self.merged, self.moe = folder, merged, moe
        self.mass, self.exact = routing_mass(moe)
        self.slices: dict = {}  # (layer prefix, slice) -> that slice's expert tensors
        self.rows: dict = {}  # stacked expert tensor -> (first expert, count) this rank holds (default: all)

    @staticmethod
    def dense_name(name: str) -> str | None:
        """The dense MLP tensor an expert tensor is made from (None for any other tensor)."""
        m = _EXPERT.match(name)
        if m is None:
            return None
        prefix, part = m.group(1), m.group(3) or _STACKED[m.group(4)]
        return f"{prefix}mlp.linear_{part}"

    def __contains__(self, name: str) -> bool:
        dense = self.dense_name(name)
        return (dense or name) in self.merged

    def _expert(self, prefix: str, expert: int) -> dict:
        g = self.moe.moe_upcycling_granularity
        key = (prefix, expert % g)
        if key not in self.slices:
            dense = {k: self.merged[f"{prefix}mlp.linear_{k}"] for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
                     if f"{prefix}mlp.linear_{k}" in self.merged}
            width, rows = dense["fc2.weight"].shape[1], dense["fc1.weight"].shape[0]
            if width % g or width // g != self.moe.moe_ffn_hidden_size:
                fits = f"set --moe-ffn-hidden-size {width // g}" if width % g == 0 else "pick a granularity dividing it"
                raise CheckpointError(f"--moe-use-upcycling: the dense MLPs of checkpoint {self.folder} are {width} wide, "
                                      f"which --moe-upcycling-granularity {g} cuts into experts {width / g:g} wide, not "
                                      f"--moe-ffn-hidden-size {self.moe.moe_ffn_hidden_size}; {fits}")
            self.slices[key] = expert_from_dense(dense, expert, g, rows == 2 * width, self.mass)
        return self.slices[key]

    def __getitem__(self, name: str) -> torch.Tensor:
        m = _EXPERT.match(name)
        if m is None:
            return self.merged[name]
        prefix = m.group(1)
        if m.group(2) is not None:
            return self._expert(prefix, int(m.group(2)))[m.group(3)]
        part = _STACKED[m.group(4)]
        first, count = self.rows.get(name, (0, self.moe.num_experts))
        pieces = [self._expert(prefix, e)[part] for e in range(first, first + count)]
        return torch.stack([p.t() if part.endswith("weight") else p for p in pieces])  # [E, in, out] / [E, n]

    def extra(self, whole_model: set) -> list[str]:
        """Dense tensors this model has no place for (an MoE layer's dense MLP is its experts' source)."""
        return sorted(k for k in self.merged if not _used(k, whole_model))

    def own_rows(self, t):
        """``t`` (a rank tensor) placed among this rank's experts only when it is a stacked expert tensor
        (whose experts this source then builds alone), else ``t``."""
        m = _EXPERT.match(t.name)
        if m is None or m.group(4) is None:
            return t
        self.rows[t.name] = (t.offset[0], t.local[0])
        return dataclasses.replace(t, offset=(0,) + tuple(t.offset[1:]), global_shape=(t.local[0],) + tuple(t.global_shape[1:]))


def _used(name: str, whole_model: set) -> bool:
    """Whether the MoE model (``whole_model``: its names at TP 1, EP 1) has a use for dense tensor ``name``."""
    m = _DENSE_MLP.match(name)
    return name in whole_model or is_fp8_state_key(name) or (m is not None and f"{m.group(1)}mlp.router.weight" in whole_model)


def _fresh(name: str) -> bool:
    """The router's tensors: not in a dense checkpoint, they keep their fresh initialisation."""
    return name.endswith(_FRESH)


def _refuse(folder: str, problems: list) -> None:
    if problems:
        raise CheckpointError(f"--moe-use-upcycling: checkpoint {folder} does not fit the model: "
                              f"{'; '.join(problems[:3])}; match its model flags")


def _load_dist_kept(folder: str, tensors, whole_model: set, config) -> list:
    """torch_dist: this rank's tensors loaded as they are (all but the experts and routers) read from
    the saved boxes overlapping them; returns the others."""
    saved = read_common(folder)["config"]
    _check_dense(folder, saved, config)
    index = read_index(folder)
    kept = [t for t in tensors if not _Upcycled.dense_name(t.name) and not _fresh(t.name)]
    missing = sorted({t.name for t in kept if ("weight", t.name) not in index and not is_fp8_state_key(t.name)})
    extra = sorted(name for kind, name in index if kind == "weight" and not _used(name, whole_model))
    _refuse(folder, ([f"missing in the checkpoint: {', '.join(missing[:3])}"] if missing else [])
            + ([f"not in this model: {', '.join(extra[:3])}"] if extra else []))
    # the padded vocabulary cut or zero-padded to this run's, saved padding rows kept (as cut_merged does)
    load_weights(folder, index, [t for t in kept if ("weight", t.name) in index], None)
    return [t for t in tensors if _Upcycled.dense_name(t.name) or _fresh(t.name)]


def upcycle_here(chunks, optimizer, root: str, config, state) -> None:
    """This rank's part of the upcycling load (local: no collectives; the caller runs it on every rank).
    Only the dense tensors of this rank's layers are read and merged, only its experts derived."""
    folder, iteration = checkpoint_folder(root, "--load")
    g = config.moe.moe_upcycling_granularity
    with full_params(chunks, load=True, partial=True):  # ZeRO-3: full storage, the routers' init kept
        tensors, _ = rank_tensors(chunks, state)
        whole_model = set(chunk_model(config.flat()).state_dict())
        if is_dist_folder(folder):  # only the boxes of what is kept as it is; the experts' dense MLPs whole
            tensors = _load_dist_kept(folder, tensors, whole_model, config)
        dense = {t.name: _Upcycled.dense_name(t.name) or t.name for t in tensors}  # the dense tensor each is made of
        required = [dense[t.name] for t in tensors if not _fresh(t.name)]
        merged, saved = merge_for_rank(folder, set(dense.values()), lambda k: not _used(k, whole_model), required)
        _check_dense(folder, saved, config)
        source = _Upcycled(folder, merged, config.moe)
        tensors = [source.own_rows(t) for t in tensors]  # grouped experts: only this rank's are built
        extra = source.extra(whole_model)
        _refuse(folder, cut_merged(source, tensors, _fresh, [f"not in this model: {', '.join(extra[:3])}"] if extra else []))
        for t in tensors:
            if t.name.endswith((".mlp.router.weight", ".mlp.router.bias")):
                share_router_rows(t.value, g)
    if optimizer is not None:  # fp32 masters from the loaded weights, or the first step would undo the load
        optimizer.reload_model_params()
    e = config.moe.num_experts
    note = "" if source.exact else "; with --moe-router-pre-softmax the upcycled layers only approximate the dense MLPs"
    print_rank_0(f"  upcycled the dense checkpoint {folder} (iteration {iteration}): {e // g} copies of each MoE "
                 f"layer's MLP" + (f", each cut into {g} experts" if g > 1 else "") + f", expert outputs x "
                 f"{g / source.mass:g}, routers fresh; starting at iteration 0 with a fresh optimizer{note}")
