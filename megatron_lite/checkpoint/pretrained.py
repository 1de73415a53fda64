"""Model weights only, from any checkpoint, for fine-tuning: ``--pretrained-checkpoint`` and ``--finetune``.

:func:`load_model_weights` fills this rank's model chunks from a checkpoint of either format and
any tensor x pipeline (x virtual pipeline) x expert layout, whatever this run's layout is; the
optimizer, learning-rate schedule, RNG states, iteration and consumed samples are NOT loaded
(Megatron's finetune semantics: the run starts at iteration 0 with a fresh optimizer, whose fp32
master weights are refreshed from the loaded weights).

* ``torch_dist``: each rank reads only the saved boxes overlapping its own shards
  (:func:`~megatron_lite.checkpoint.dist.load_weights`).
* ``torch`` at this run's layout (same TP, PP, EP sizes and layer ranges): each rank reads its own
  ``mp_rank_*`` file, as a resume does.
* ``torch`` at another layout: each rank merges into single-process tensors only the tensors it holds
  (:func:`merge_for_rank`: the model files of the pipeline stages holding its layers, its
  embedding or output layer, read whole; the other stages' files are not read) and cuts its shards
  out of them with the same placement (:func:`~megatron_lite.checkpoint.dist.rank_tensors`:
  tensor-parallel offsets, global layer and expert numbers) the sharded format uses. ``torch_dist``
  reads less still (only the saved boxes overlapping its shards).

The vocabulary padding may differ (it depends on the TP size): the rows of the real vocabulary are
kept. The model flags that decide shapes must match the checkpoint's (arch_flags.SHAPE_FLAGS; the others
may change on purpose); a missing tensor, an extra one or a wrong shape is one :class:`CheckpointError`. ``missing_ok(name)`` lets a model
hold tensors the checkpoint has not (e.g. adapters added for fine-tuning keep their own init).
A Hugging Face model is imported first with ``tools/checkpoint/convert.py``.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from ..console import print_rank_0
from ..lora.config import model_targets
from ..parallel.fsdp import full_params
from ..precision.fp8 import is_fp8_state_key
from .arch import check_architecture
from .boxes import full_shape, region
from .dist import load_weights, rank_tensors, zero_absent_router_biases
from .dist_read import is_dist_folder, read_common, read_index
from .format import (
    TRACKER_FILENAME,
    VOCAB_TENSORS,
    CheckpointError,
    iteration_dir,
    model_file,
    on_every_rank,
    read_model_file,
    read_tracker,
)
from .frozen import base_reference, has_frozen, unwrap
from .layout import chunk_model
from .merge import merge_checkpoint
from .router_bias import fill_state_dict, say_filled


def checkpoint_folder(path: str, flag: str) -> tuple[str, int | str]:
    """(iteration folder, iteration) of ``path``: a save folder (its latest checkpoint) or an
    ``iter_*`` folder. One CheckpointError when there is no checkpoint there."""
    if os.path.isfile(os.path.join(path, TRACKER_FILENAME)):
        iteration = read_tracker(path)
        return iteration_dir(path, iteration), iteration
    if os.path.isdir(path) and any(n.startswith("mp_rank_") or n == "common.pt" for n in os.listdir(path)):
        name = os.path.basename(os.path.normpath(path))  # iter_0000002 is iteration 2; release (or another name) as it is
        return path, int(name[5:]) if re.fullmatch(r"iter_\d+", name) else name
    reason = "it does not exist" if not os.path.exists(path) else "it holds no checkpoint"
    raise CheckpointError(f"{flag} {path}: {reason}; point it at a checkpoint folder (a Hugging Face model is "
                          "imported with tools/checkpoint/convert.py --loader hf first)")


def _fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with its first dim cut or zero-padded to ``rows`` (the padded vocabulary)."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def _optional(name: str, missing_ok) -> bool:
    """A tensor the checkpoint need not have: FP8 bookkeeping, or what ``missing_ok`` accepts."""
    return is_fp8_state_key(name) or bool(missing_ok and missing_ok(name))


def _load_dist_weights(folder: str, chunks, state, missing_ok, vocab_size: int) -> None:
    """This rank's tensors from the boxes of a torch_dist checkpoint (those it has); the vocabulary
    (``vocab_size`` real rows) is re-padded for this run's TP size."""
    index = read_index(folder)
    everything = rank_tensors(chunks, state)[0]
    filled = zero_absent_router_biases(everything, index, folder)
    tensors = [t for t in everything if t.name not in filled
               and (("weight", t.name) in index or not _optional(t.name, missing_ok))]
    load_weights(folder, index, tensors, vocab_size)


def merge_for_rank(folder: str, tensors, keep_extra, required) -> tuple[dict, dict]:
    """:func:`~megatron_lite.checkpoint.merge.merge_checkpoint` of only what this rank needs: the
    single-process tensors of ``tensors`` (:func:`~megatron_lite.checkpoint.dist.rank_tensors`' names, or
    what ``tensors`` is, a set of names), and those ``keep_extra(name)`` accepts (tensors of no place in
    the model, to report). When a ``required`` name is not found that way, the whole checkpoint is
    merged, for the same report as before."""
    names = {getattr(t, "name", t) for t in tensors}
    merged, saved = merge_checkpoint(folder, keep=lambda name: name in names or keep_extra(name))
    if any(name not in merged for name in required):
        merged, saved = merge_checkpoint(folder)
    return merged, saved


def _load_merged(folder: str, chunks, config, state, missing_ok, check) -> None:
    """Cut this rank's tensors out of the merged (single-process) torch-format checkpoint (``check``:
    the saved config's check); only the model files and tensors of this rank's layers are read."""
    tensors, _ = rank_tensors(chunks, state)
    whole_model = set(chunk_model(config.flat()).state_dict())  # every rank's tensors, at TP 1 and EP 1
    required = [t.name for t in tensors if not _optional(t.name, missing_ok)]
    merged, saved = merge_for_rank(folder, tensors, lambda k: k not in whole_model and not is_fp8_state_key(k), required)
    check(saved)
    extra = sorted(k for k in merged if k not in whole_model and not is_fp8_state_key(k))
    problems = cut_merged(merged, tensors, missing_ok, [f"not in this model: {', '.join(extra[:3])}"] if extra else [])
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not fit the model: {'; '.join(problems[:3])}; "
                              "match the model flags")


def cut_merged(merged, tensors, missing_ok, extra=()) -> list[str]:
    """Copy each of this rank's ``tensors`` (:func:`~megatron_lite.checkpoint.dist.rank_tensors`) out of
    ``merged``, single-process tensors by global name (any mapping with ``in`` and ``[]``); the padded
    vocabulary is re-padded. Returns the problems (a tensor missing, ``extra``, a wrong shape) as short phrases."""
    missing = sorted({t.name for t in tensors if t.name not in merged and not _optional(t.name, missing_ok)})
    problems = ([f"missing in the checkpoint: {', '.join(missing[:3])}"] if missing else []) + list(extra)
    with torch.no_grad():
        for t in tensors:
            if t.name not in merged:
                continue
            full = merged[t.name]
            shape = full_shape(t.global_shape, t.dim)
            if t.name in VOCAB_TENSORS:
                full = _fit_rows(full, shape[0])
            if tuple(full.shape) != tuple(shape):
                problems.append(f"{t.name} is {tuple(full.shape)} in the checkpoint, {tuple(shape)} in this model")
                continue
            piece = region(full.reshape(t.global_shape), (0,) * len(t.global_shape), t.offset, t.local)
            t.value.detach().view(t.local).copy_(piece)
    return problems


def _layer_ranges(chunks) -> list:
    out = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        holder = module if hasattr(module, "layer_start") else getattr(module, "decoder", None)
        start = getattr(holder, "layer_start", None)
        out.append(None if start is None else [int(start), int(holder.layer_end)])
    return out


def _own_file(folder: str, chunks, config, state) -> dict | None:
    """This rank's model file when the checkpoint was saved at this run's layout and vocabulary padding,
    else None: a folded expert grid (the merged route, whose cut follows the experts' own ETP rank), or
    another padded vocabulary (another --make-vocab-size-divisible-by or vocabulary: the merged route
    re-pads it, where this rank's rows of the saved padding would be the wrong rows at TP > 1)."""
    if getattr(state, "folded", False):
        return None
    mine = model_file("", 0, state.tp_rank, state.pp_rank, state.ep_rank if state.ep_size > 1 else None)
    path = os.path.join(folder, os.path.relpath(mine, iteration_dir("", 0)))  # mp_rank_TT_PPP[_EEE]/<file>
    if not os.path.isfile(path):
        return None
    payload = read_model_file(path)
    saved = [None if r is None else list(r) for r in payload.get("layer_ranges", [])]
    same = (payload["tp_size"], payload["pp_size"], payload.get("ep_size", 1)) == (state.tp_size, state.pp_size,
                                                                                  state.ep_size)
    padded = payload["config"].get("padded_vocab_size")  # None: saved before it was recorded
    same = same and padded in (None, config.model.padded_vocab_size)
    return payload if same and saved == _layer_ranges(chunks) else None


def _load_own_file(folder: str, payload: dict, chunks, missing_ok, check) -> None:
    """Each chunk's weights from this rank's model file (same layout): names and shapes checked."""
    check(payload["config"])
    problems = []
    with torch.no_grad():
        for chunk, saved in zip(chunks, payload["model"]):
            mine = getattr(chunk, "module", chunk).state_dict()
            say_filled(folder, fill_state_dict(saved, mine))
            problems += [f"missing in the checkpoint: {k}" for k in mine if k not in saved and not _optional(k, missing_ok)]
            problems += [f"not in this model: {k}" for k in saved if k not in mine and not is_fp8_state_key(k)]
            for key, value in mine.items():
                if key not in saved or not torch.is_tensor(value):
                    continue
                if tuple(saved[key].shape) != tuple(value.shape):
                    problems.append(f"{key} is {tuple(saved[key].shape)} in the checkpoint, {tuple(value.shape)} here")
                else:
                    value.copy_(saved[key])
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not fit the model: {'; '.join(problems[:3])}; "
                              "match the model flags")


def load_model_weights_here(chunks, optimizer, path: str, config, state, flag: str = "--pretrained-checkpoint",
                            missing_ok=None, every_flag: bool = False) -> str:
    """This rank's part of :func:`load_model_weights` (local: no collectives). Returns the folder.
    The saved model flags that decide shapes must be this run's, all of them with ``every_flag``
    (a converted ``release`` checkpoint loaded without --finetune)."""
    folder, iteration = checkpoint_folder(path, flag)
    dist_format = is_dist_folder(folder)

    def check(saved):
        if saved.get("lora_rank"):
            raise CheckpointError(f"checkpoint {folder} holds LoRA adapters only; merge them into their base first "
                                  "(tools/checkpoint/convert.py --load-dir it) and load the merged checkpoint")
        check_architecture(folder, saved, config, "release" if every_flag else "weights")

    # ZeRO-3: full-size storage to load into, then re-sharded (gathered first when some may stay as they are)
    with full_params(chunks, load=True, partial=missing_ok is not None):
        if dist_format:
            saved = read_common(folder)["config"]
            check(saved)
            _load_dist_weights(folder, chunks, state, missing_ok, saved.get("vocab_size"))
        elif (payload := _own_file(folder, chunks, config, state)) is not None:
            _load_own_file(folder, payload, chunks, missing_ok, check)
        else:
            _load_merged(folder, chunks, config, state, missing_ok, check)
    if optimizer is not None:  # fp32 masters from the loaded weights, or the first step would undo the load
        optimizer.reload_model_params()
    fresh = "; starting at iteration 0 with a fresh optimizer" if optimizer is not None else ""
    print_rank_0(f"  loaded model weights from {folder} (iteration {iteration}, "
                 f"{'torch_dist' if dist_format else 'torch'} format){fresh}")
    return folder


def load_model_weights(chunks, optimizer, path: str, config, state, flag: str = "--pretrained-checkpoint",
                       missing_ok=None) -> str:
    """Load only the model weights of the checkpoint at ``path`` into ``chunks`` (see the module
    docstring); every rank calls it, and a problem on any rank is one CheckpointError on all."""
    return on_every_rank(lambda: load_model_weights_here(chunks, optimizer, path, config, state, flag, missing_ok))


# A model with frozen (LoRA) parameters: which of its parameters a base checkpoint lacks, and which base to load
def trainable_may_be_missing(chunks, state):
    """With frozen parameters: a predicate accepting the names (chunk-local or global) of the
    parameters that train, which a base checkpoint does not have (None when nothing is frozen)."""
    if not has_frozen(chunks):
        return None
    names = {t.name for t in rank_tensors(chunks, state)[0] if isinstance(t.value, nn.Parameter) and t.value.requires_grad}
    names |= {k for c in chunks for k, v in unwrap(c).state_dict(keep_vars=True).items()
              if isinstance(v, nn.Parameter) and v.requires_grad}
    return names.__contains__


def check_base(path: str, saved: dict | None, chunks, pretrained: str | None) -> str | None:
    """The base folder to load before resuming from checkpoint ``path`` (whose record is ``saved``),
    or None when there is none to load; one CheckpointError for any mismatch."""
    frozen = has_frozen(chunks)
    if saved is None:
        if frozen:
            raise CheckpointError(f"checkpoint {path} holds a full model, but this run freezes its base (LoRA); "
                                  "start from it with --pretrained-checkpoint instead of --load")
        return None
    if not frozen:
        raise CheckpointError(f"checkpoint {path} holds only the trained parameters (LoRA adapters) of the base "
                              f"{saved['folder']}; resume with the same --lora-* flags, or merge it with "
                              "tools/checkpoint/convert.py")
    folder = saved["folder"]
    if pretrained:
        given, _ = checkpoint_folder(pretrained, "--pretrained-checkpoint")
        if os.path.abspath(given) != folder and base_reference(given)["fingerprint"] != saved["fingerprint"]:
            raise CheckpointError(f"--pretrained-checkpoint {pretrained} is not the base checkpoint {path} was "
                                  f"trained on ({folder}); drop the flag or point it there")
        folder = os.path.abspath(given)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint {path} was trained on the base {folder}, which is gone; restore it "
                              "there (or pass its new place as --pretrained-checkpoint)")
    if base_reference(folder)["fingerprint"] != saved["fingerprint"]:
        raise CheckpointError(f"the base {folder} of checkpoint {path} has changed since it was trained "
                              "(its files differ); restore that base")
    return folder


def check_lora_resume(path: str, saved: dict, lora) -> None:
    """Resuming LoRA checkpoint ``path`` (saved flat config ``saved``; ``lora``: this run's LoRAConfig):
    its adapters were trained with its --lora-rank, --lora-alpha and --lora-target-modules, which
    decide the model (alpha / rank scales every adapter, and a merge uses the saved alpha), so another
    value is one CheckpointError naming the flag. --lora-dropout changes training, not the model: free."""
    present = model_targets(bool(saved.get("multi_latent_attention")), saved.get("q_lora_rank"))

    def differs(name, mine):
        if name == "lora_target_modules":  # the layers adapted (a name the model has no layer of adapts none)
            return sorted({t for t in saved[name] or [] if t in present}) != sorted({t for t in mine or [] if t in present})
        return float(saved[name]) != float(mine)

    differ = [f"--{name.replace('_', '-')} {' '.join(saved[name]) if isinstance(saved[name], list) else saved[name]} "
              f"(this run {' '.join(mine) if isinstance(mine, list) else mine})"
              for name in ("lora_rank", "lora_alpha", "lora_target_modules")
              if saved.get(name) is not None and differs(name, mine := getattr(lora, name))]
    if differ:
        raise CheckpointError(f"checkpoint {path} holds adapters trained with {', '.join(differ)}; resume with its "
                              "--lora-* values, or merge it (tools/checkpoint/convert.py) and train new adapters on "
                              "the merged model with --pretrained-checkpoint")
