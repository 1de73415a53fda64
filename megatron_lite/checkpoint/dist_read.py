"""Reading the sharded (``torch_dist``) format: the index of saved boxes, filling any rank's tensors
from it, and merging whole tensors for the tools.

A ``torch_dist`` iteration folder holds ``common.pt`` (iteration, config, layout, schedule, the
optimizer's scalars; written by rank 0), ``rng/rank_*.pt`` (one per rank) and a
``torch.distributed.checkpoint`` (DCP) checkpoint: ``.metadata`` plus one ``__<rank>_0.distcp`` per
rank. Every DCP key is ``<kind>/<global tensor name>/<offset>``: a box (see
:mod:`~megatron_lite.checkpoint.boxes`) of the canonical form of one global tensor, where kind is
``weight``, ``master`` (fp32 master weights) or an optimizer state (``exp_avg``, ``exp_avg_sq``,
``momentum_buffer``). Boxes of one tensor never overlap, so a reader sums their sizes to check the
tensor is complete, and loads only the keys overlapping what it needs. ``checksums/rank_*.pt`` hold
the CRC-32 of every key each rank wrote; every key read is verified against it. A reader always reads
whole saved keys (at any layout), so a key's CRC-32 verifies whatever part of it a rank needs. Data
files shorter than the pieces ``.metadata`` places in them are refused before anything is read. A
checkpoint saved before checksums existed has no such folder: it is read unverified, with one warning
(``common.pt`` of a newer one says it had checksums, so losing the folder is refused).
"""

from __future__ import annotations

import glob
import math
import os
import warnings

import torch

from .boxes import extent, full_shape, intersect, region
from .format import (
    CHECKSUMS_KEY,
    DIST_COMMON_FILENAME,
    TRACKER_FILENAME,
    CheckpointError,
    iteration_dir,
    load_file,
    read_tracker,
    tensor_crc,
)
from .router_bias import fill_merged

DIST_METADATA = ".metadata"  # DCP writes it once every rank's data is on disk
DIST_CHECKSUMS_DIR = "checksums"
PIECE_CHECKSUMS_MARK = "piece_checksums"  # in common.pt: the pieces were saved with checksums/
COMMON_KEYS = ("format", "iteration", "consumed_samples", "config", "layout", "optimizer", "scheduler", "partition")


def is_dist_folder(folder: str) -> bool:
    """True when ``folder`` (an iteration folder) holds a torch_dist checkpoint."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in (DIST_COMMON_FILENAME, DIST_METADATA))


def checkpoint_format(root: str, iteration, ck) -> str:
    """The format of checkpoint ``iteration`` under ``root``; it must be ``ck.ckpt_format`` (the
    run's CheckpointConfig) unless ``--auto-detect-ckpt-format``."""
    found = "torch_dist" if is_dist_folder(iteration_dir(root, iteration)) else "torch"
    if found != ck.ckpt_format and not ck.auto_detect_ckpt_format:
        raise CheckpointError(f"checkpoint {iteration_dir(root, iteration)} is in the {found} format but this run has "
                              f"--ckpt-format {ck.ckpt_format}; pass --ckpt-format {found} or --auto-detect-ckpt-format")
    return found


def resolve_folder(path: str) -> str:
    """The iteration folder of ``path``: a save folder (its latest iteration) or an iteration folder."""
    if os.path.isfile(os.path.join(path, TRACKER_FILENAME)):
        return iteration_dir(path, read_tracker(path))
    return path


def key_of(kind: str, name: str, offset) -> str:
    return f"{kind}/{name}/{'_'.join(str(int(o)) for o in offset)}"


def read_common(folder: str) -> dict:
    return load_file(os.path.join(folder, DIST_COMMON_FILENAME), "torch_dist checkpoint file", keys=COMMON_KEYS)


class SavedIndex(dict):
    """``{(kind, name): [(offset, size, dtype, key)]}``; ``checksums``: ``{key: CRC-32}`` (empty when
    the checkpoint has none); ``files``: ``{key: data file name}``."""

    checksums: dict
    files: dict


_WARNED_UNVERIFIED: set = set()


def _warn_unverified(folder: str) -> None:
    """One warning line (global rank 0, once per folder and process): no checksums to verify against."""
    import torch.distributed as dist

    if folder in _WARNED_UNVERIFIED or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    _WARNED_UNVERIFIED.add(folder)
    print(f"WARNING: torch_dist checkpoint {folder} has no checksums (saved before they existed); "
          "its tensors are read unverified", flush=True)


def _no_checksums(folder: str) -> None:
    """A checkpoint saved with checksums whose ``checksums/`` folder is gone is refused; one saved
    before checksums existed is read unverified, with one warning."""
    common = os.path.join(folder, DIST_COMMON_FILENAME)
    if os.path.isfile(common) and read_common(folder).get(PIECE_CHECKSUMS_MARK):
        raise CheckpointError(f"torch_dist checkpoint {folder} was saved with checksums but its {DIST_CHECKSUMS_DIR}/ "
                              "folder is missing or empty (copied without it?); copy it along or point --load at "
                              "another checkpoint")
    _warn_unverified(folder)


def _check_data_files(folder: str, storage: dict) -> None:
    """Every data file ``.metadata`` names exists and is long enough for the pieces it places there."""
    need = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for name, size in sorted(need.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"torch_dist checkpoint file {path} is missing; the checkpoint is incomplete "
                                  "- point --load at another checkpoint")
        if os.path.getsize(path) < size:
            raise CheckpointError(f"torch_dist checkpoint file {path} is truncated ({os.path.getsize(path)} bytes, "
                                  f"its pieces need {size}); point --load at another checkpoint")


def read_checksums(folder: str) -> dict:
    """``{key: CRC-32}`` of every key saved under ``folder`` (every rank's checksums file)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, DIST_CHECKSUMS_DIR, "rank_*.pt"))):
        out.update(load_file(path, "torch_dist checksums file", keys=(CHECKSUMS_KEY,))[CHECKSUMS_KEY])
    return out


def read_index(folder: str) -> SavedIndex:
    """``{(kind, name): [(offset, size, dtype, key)]}`` of every box saved under ``folder``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(folder, DIST_METADATA)
    if not os.path.isfile(path):
        raise CheckpointError(f"torch_dist checkpoint {folder} has no {DIST_METADATA} (the save did not complete); "
                              "point --load at a complete checkpoint")
    try:
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as err:  # truncated or foreign pickle: one clear line
        raise CheckpointError(f"torch_dist checkpoint {folder}: {DIST_METADATA} is unreadable ({type(err).__name__}); "
                              "it is corrupt - point --load at another checkpoint") from None
    _check_data_files(folder, metadata.storage_data)
    index = SavedIndex()
    index.checksums = read_checksums(folder)
    index.files = {i.fqn: info.relative_path for i, info in metadata.storage_data.items()}
    if not index.checksums:
        _no_checksums(folder)
    for key, meta in metadata.state_dict_metadata.items():
        parts = key.split("/")
        if not isinstance(meta, TensorStorageMetadata) or len(parts) != 3:
            raise CheckpointError(f"torch_dist checkpoint {folder} holds {key!r}, not a megatron_lite box; "
                                  "point --load at a megatron_lite checkpoint")
        offset = tuple(int(x) for x in parts[2].split("_")) if parts[2] else ()
        index.setdefault((parts[0], parts[1]), []).append((offset, tuple(meta.size), meta.properties.dtype, key))
    return index


def load_keys(folder: str, wanted: dict, index: SavedIndex | None = None) -> dict:
    """``{key: tensor}`` read from the DCP files (``wanted``: ``{key: (size, dtype)}``), each verified
    against ``index.checksums`` (``{key: CRC-32}``; a checkpoint with checksums must have one for every
    key); local, no collectives."""
    checksums, files = getattr(index, "checksums", {}), getattr(index, "files", {})
    for key in wanted:
        if checksums and key not in checksums:
            raise CheckpointError(f"torch_dist checkpoint {folder}: tensor {key} (in {files.get(key, '?')}) has no "
                                  f"checksum in {DIST_CHECKSUMS_DIR}/ (a checksums file is missing or damaged); "
                                  "point --load at another checkpoint")
    buffers = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in wanted.items()}
    error = _read(folder, buffers)
    if error is not None:
        groups = {}
        for key in buffers:
            groups.setdefault(files.get(key, "?"), {})[key] = buffers[key]
        culprit = next((name for name, part in sorted(groups.items()) if _read(folder, part) is not None), None)
        where = f"file {os.path.join(folder, culprit)}" if culprit else folder
        raise CheckpointError(f"torch_dist checkpoint {where} could not be read ({error}); "
                              "it is truncated or corrupt - point --load at another checkpoint")
    for key, tensor in buffers.items():
        if key in checksums and tensor_crc(tensor) != checksums[key]:
            raise CheckpointError(f"torch_dist checkpoint file {os.path.join(folder, files.get(key, '?'))}: tensor "
                                  f"{key} fails its checksum (the file is damaged); point --load at another checkpoint")
    return buffers


def _read(folder: str, buffers: dict) -> str | None:
    """Fill ``buffers`` (``{key: tensor}``) from the DCP files; None, or what went wrong (one line)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not buffers:
        return None
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(buffers, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        first = str(err).strip().splitlines()[-1][:200] if str(err).strip() else ""
        return f"{type(err).__name__}: {first}" if first else type(err).__name__
    return None


def _other_form(have, want) -> bool:
    """Whether canonical shapes ``have`` and ``want`` are two forms of one full tensor: one axis of one
    split in two in the other (a tensor marked as split over a group of ranks, at any size, vs one
    held whole: experts saved with --expert-tensor-parallel-size 1 at TP 1 or TP > 1, loaded split)."""
    a, b = (tuple(have), tuple(want)) if len(have) > len(want) else (tuple(want), tuple(have))
    if len(a) != len(b) + 1:
        return False
    return any(a[:d] == b[:d] and a[d] * a[d + 1] == b[d] and a[d + 2:] == b[d + 1:] for d in range(len(b)))


def _read_whole_where_reshaped(index: dict, requests, loose_axes: dict) -> tuple[list, list]:
    """``requests`` with each one whose saved tensor has the other form (:func:`_other_form`) replaced
    by a request for the whole saved tensor, and ``[(dest, offset, whole, global_shape)]`` to copy from."""
    out, reshaped = [], []
    for kind, name, dest, offset, global_shape in requests:
        saved = index.get((kind, name))
        have = extent((o, s) for o, s, _, _ in saved) if saved else None
        if have is not None and name not in loose_axes and _other_form(have, global_shape):
            whole = torch.zeros(have, dtype=dest.dtype)
            reshaped.append((dest, offset, whole, tuple(global_shape)))
            out.append((kind, name, whole, (0,) * len(have), have))
        else:
            out.append((kind, name, dest, offset, global_shape))
    return out, reshaped


def fill(folder: str, index: dict, requests, loose_axes: dict | None = None) -> None:
    """Fill each request ``(kind, name, dest, offset, global_shape)`` (``dest`` a tensor placed at
    ``offset`` in the canonical tensor of ``global_shape``) from the saved boxes overlapping it.

    The saved tensor must have ``global_shape`` (or its other canonical form: whole instead of split
    over a group, or the other way round, read whole and reshaped), except along the axis of ``loose_axes[name] = (axis,
    rows)`` (the padded vocabulary, whose padding depends on the TP size): where the saved size there
    differs, only its first ``rows`` (the real vocabulary) are read and the rest of ``dest`` is zero,
    as the converter re-pads."""
    loose_axes = loose_axes or {}
    requests, reshaped = _read_whole_where_reshaped(index, requests, loose_axes)
    plan, wanted = [], {}
    for kind, name, dest, offset, global_shape in requests:
        saved = index.get((kind, name))
        if not saved:
            raise CheckpointError(f"torch_dist checkpoint {folder} has no {kind} for {name}; it was saved from another "
                                  "model - match the model flags")
        have = extent((o, s) for o, s, _, _ in saved)
        loose, rows = loose_axes.get(name, (None, None))
        if any(h != g for axis, (h, g) in enumerate(zip(have, global_shape)) if axis != loose) or len(have) != len(global_shape):
            raise CheckpointError(f"torch_dist checkpoint {folder}: {kind} of {name} has shape "
                                  f"{full_shape(have, None)} (canonical), this model needs {tuple(global_shape)}; "
                                  "match the model flags")
        if loose is not None and have[loose] != global_shape[loose]:  # re-pad: the real rows only
            have = have[:loose] + (min(rows or have[loose], have[loose]),) + have[loose + 1:]
        inside = intersect(offset, dest.shape, (0,) * len(have), have)
        covered = 0
        for s_off, s_size, dtype, key in saved:
            part = intersect(offset, dest.shape, s_off, s_size)
            part = part and intersect(*part, (0,) * len(have), have)
            if part is not None:
                plan.append((dest, offset, key, s_off, part))
                wanted[key] = (s_size, dtype)
                covered += math.prod(part[1])
        if covered != (0 if inside is None else math.prod(inside[1])):
            raise CheckpointError(f"torch_dist checkpoint {folder} is incomplete: pieces of {kind} {name} are missing; "
                                  "point --load at a complete checkpoint")
        if inside is None or math.prod(inside[1]) < dest.numel():
            dest.zero_()  # padded vocabulary rows this checkpoint did not have
    buffers = load_keys(folder, wanted, index)
    with torch.no_grad():
        for dest, offset, key, s_off, (i_off, i_size) in plan:
            region(dest, offset, i_off, i_size).copy_(region(buffers[key], s_off, i_off, i_size))
        for dest, offset, whole, global_shape in reshaped:  # the other form: a reshape of the full tensor
            dest.copy_(region(whole.reshape(global_shape), (0,) * len(global_shape), offset, dest.shape))


def merge_kind(folder: str, index: dict, kind: str, partition: dict, keep=None) -> dict:
    """``{name: full tensor}`` of one kind (``partition[name]``: the partition dim, or absent); with
    ``keep`` (a predicate on names), only the tensors it accepts are read."""
    out = {}
    for (k, name), saved in sorted(index.items()):
        if k != kind or (keep is not None and not keep(name)):
            continue
        shape = extent((o, s) for o, s, _, _ in saved)
        full = torch.zeros(shape, dtype=saved[0][2])
        fill(folder, index, [(kind, name, full, (0,) * len(shape), shape)])
        out[name] = full.reshape(full_shape(shape, partition.get(name)))
    return out


def merge_dist(path: str, filled: list | None = None, keep=None) -> tuple[dict, dict]:
    """(single-process state dict, saved flat config with ``iteration`` and ``consumed_samples``) of a
    torch_dist checkpoint: what :func:`~megatron_lite.checkpoint.merge.merge_checkpoint` gives for torch
    (``keep``: only the tensors it accepts)."""
    folder = resolve_folder(path)
    common = read_common(folder)
    index = read_index(folder)
    config = dict(common["config"])
    config.setdefault("iteration", common["iteration"])
    config.setdefault("consumed_samples", common["consumed_samples"])
    merged = merge_kind(folder, index, "weight", common["partition"], keep)
    (filled if filled is not None else []).extend(fill_merged(merged, config, path))
    return merged, config


def merge_dist_optimizer(path: str) -> dict | None:
    """The layout-free optimizer state of a torch_dist checkpoint in the form
    :func:`~megatron_lite.checkpoint.reshard_optim.merge_optimizer` returns (vocabulary still padded)."""
    folder = resolve_folder(path)
    common = read_common(folder)
    opt = common["optimizer"]
    if opt is None:
        return None
    index = read_index(folder)
    kinds = {k for k, _ in index}
    partition = common["partition"]
    state = {key: merge_kind(folder, index, key, partition) for key in opt["state_keys"] if key in kinds}
    scalars = {"step": torch.tensor(float(opt["step"]))} if opt["name"] in ("adam", "muon") and state else {}
    masters = merge_kind(folder, index, "master", partition) if "master" in kinds else None
    return {"state": state, "scalars": scalars, "masters": masters, "group": opt["hyper"],
            "extra": {"loss_scaler": opt["loss_scaler"], "num_skipped_steps": opt["num_skipped_steps"]},
            "weight_decay": opt["weight_decay"], "scheduler": common["scheduler"]}
