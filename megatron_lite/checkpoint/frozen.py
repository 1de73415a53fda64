"""Frozen parameters (``requires_grad = False``, e.g. the base weights under LoRA) in checkpoints.

The rule: a training checkpoint holds the parameters that train (and the buffers), never the frozen
ones - those are a copy of the base checkpoint they were loaded from, and would make a LoRA
checkpoint as large as the model. Instead the checkpoint records a *base reference*: the base's
iteration folder (absolute), its iteration and a fingerprint of its files.

* The base is the checkpoint whose weights filled the model: ``--pretrained-checkpoint`` (or
  ``--load`` with ``--finetune``); :func:`set_base` keeps its reference on the model chunks.
* Saving a model with frozen parameters but no base reference is refused (nothing could restore them).
* Resuming (``--load`` holds a checkpoint that records a base) loads the base's weights first, from
  the recorded folder, then the checkpoint's trainable tensors and optimizer state. It is refused in
  one line when the base folder is gone or its fingerprint changed, or when ``--pretrained-checkpoint``
  names another base.

A model without frozen parameters saves and loads exactly as before (every tensor, no reference).
"""

from __future__ import annotations

import hashlib
import os

from torch import nn

from ..precision.fp8 import is_fp8_state_key
from .format import CheckpointError


def is_frozen(value) -> bool:
    return isinstance(value, nn.Parameter) and not value.requires_grad


def unwrap(chunk):
    """The module inside a data-parallel wrapper (or the chunk itself)."""
    return getattr(chunk, "module", chunk)


def has_frozen(chunks) -> bool:
    return any(is_frozen(p) for c in chunks for p in unwrap(c).parameters())


def frozen_names(module) -> set[str]:
    """State-dict names of ``module``'s frozen parameters."""
    return {k for k, v in module.state_dict(keep_vars=True).items() if is_frozen(v)}


def saved_state_dict(module) -> dict:
    """``module``'s state dict without its frozen parameters (what a checkpoint holds)."""
    skip = frozen_names(module)
    return {k: v for k, v in module.state_dict().items() if k not in skip}


def fit_fp8_state(module, saved: dict) -> dict:
    """``saved`` fitted to ``module``'s FP8 bookkeeping (amax histories, scales): left out when
    ``module`` has no FP8 gemm (a run without --fp8-format resumes the same weights); when the
    checkpoint has none (it was saved without --fp8-format), ``module``'s fresh ones, so the scaling
    starts over as in a new FP8 run; an amax history of another length (--fp8-amax-history-len
    changed), ``module``'s fresh one, while the saved scales are kept."""
    mine = {k: v for k, v in module.state_dict().items() if is_fp8_state_key(k)}
    if not mine:
        return {k: v for k, v in saved.items() if not is_fp8_state_key(k)}
    if not any(is_fp8_state_key(k) for k in saved):
        return {**saved, **mine}
    return {**saved, **{k: v for k, v in mine.items() if other_history_length(k, saved.get(k), v.shape)}}


def other_history_length(name: str, saved, shape) -> bool:
    """Whether ``name`` is an FP8 amax history saved with another length than ``shape``'s (``saved``:
    the saved tensor or its shape; None: not saved)."""
    saved_shape = getattr(saved, "shape", saved)
    return (name.endswith(".gemm.amax_history") and saved_shape is not None
            and tuple(saved_shape)[1:] == tuple(shape)[1:] and tuple(saved_shape) != tuple(shape))


def load_saved_state(module, saved: dict) -> None:
    """Load a :func:`saved_state_dict` (strict about every tensor that is not frozen)."""
    result = module.load_state_dict(saved, strict=False)
    missing = sorted(set(result.missing_keys) - frozen_names(module))
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint does not fit the model: missing {missing[:3]}, "
                              f"unexpected {list(result.unexpected_keys)[:3]}")


def _fingerprint(folder: str, edge: int = 1 << 16) -> str:
    """A hash of the files under ``folder``: names, sizes and their first and last 64 KiB (a torch.save
    file ends with its zip directory, which holds the CRC-32 of every record), so a rewrite shows."""
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            digest.update(f"{os.path.relpath(path, folder)}:{size}\n".encode())
            with open(path, "rb") as f:
                digest.update(f.read(edge))
                f.seek(max(0, size - edge))
                digest.update(f.read(edge))
    return digest.hexdigest()[:16]


def base_reference(folder: str) -> dict:
    """The record of base checkpoint ``folder`` (an iteration folder)."""
    folder = os.path.abspath(folder)
    return {"folder": folder, "iteration": os.path.basename(folder), "fingerprint": _fingerprint(folder)}


def set_base(chunks, reference: dict | None) -> None:
    for chunk in chunks:
        unwrap(chunk).frozen_base = reference


def base_of(chunks) -> dict | None:
    """The base reference to save with a model that has frozen parameters (None: nothing is frozen)."""
    if not has_frozen(chunks):
        return None
    reference = getattr(unwrap(chunks[0]), "frozen_base", None)
    if reference is None:
        raise CheckpointError("the model has frozen parameters (LoRA) but no base checkpoint was loaded, so a "
                              "checkpoint could not restore them; start from --pretrained-checkpoint")
    return reference


def require_base(chunks, load: str | None) -> None:
    """After loading: a model with frozen parameters must have its base loaded (else it trains
    adapters on random weights that no checkpoint could restore)."""
    if has_frozen(chunks) and getattr(unwrap(chunks[0]), "frozen_base", None) is None:
        raise CheckpointError(f"--load {load} holds no checkpoint and no --pretrained-checkpoint was given: LoRA "
                              "needs the base model to adapt; pass --pretrained-checkpoint")


