"""Which checkpoints a run keeps: ``--save-retain-interval`` and the non-persistent checkpoints.

After a save is complete (its folder renamed into place and the tracker naming it written; for an
``--async-save`` once the loop has heard that its background write landed) rank 0 deletes the older
checkpoints the flags do not keep:

- in ``--save`` with ``--save-retain-interval R``: every ``iter_N`` older than the one just saved
  whose N is not a multiple of R (as in Megatron-LM, which deletes the previous save's unless R divides
  its iteration);
- in the non-persistent folder (``--non-persistent-save-interval``): every ``iter_N`` older than the
  one just saved.

Only real folders named exactly ``iter_XXXXXXX`` (seven or more digits) are touched: never a symbolic
link, never the iteration the tracker names, never a ``.tmp_iter_*`` being written, never anything
else in the folder. A folder is first renamed to ``.del_iter_N`` (one atomic step) and then removed,
so a run killed while deleting leaves every ``iter_N`` whole; loading, the folder listing and the
converter ignore ``.del_*`` folders, and the next deletion removes them. A deletion that fails
(permissions) is one warning; the run goes on.
"""

from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist

from ..checkpoint_config import non_persistent_dir
from ..console import print_rank_0
from .format import ASIDE_PREFIX, TRACKER_FILENAME

DELETE_PREFIX = ".del_"  # + iter_XXXXXXX: a checkpoint being deleted (renamed first, then removed)
_ITERATION = re.compile(r"iter_(\d{7,})")


def keep_every(config, root: str) -> int | None:
    """The pruning rule of the checkpoints under ``root``: None (keep all), 0 (keep only the latest:
    the non-persistent folder) or R (--save-retain-interval: multiples of R and the latest)."""
    ck = config.checkpoint
    if ck.save is not None and os.path.realpath(root) == os.path.realpath(ck.save):  # first: never "only the latest"
        return ck.save_retain_interval
    np_root = non_persistent_dir(ck, ck.save) if ck.non_persistent_save_interval else None
    if np_root is not None and os.path.realpath(root) == os.path.realpath(np_root):
        return 0
    return None


def _tracked(root: str) -> int | None:
    """The iteration the tracker names (None: none, or not a number); read raw, never repaired here."""
    try:
        with open(os.path.join(root, TRACKER_FILENAME), "rb") as f:
            return int(f.read(64).decode("ascii").strip())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def doomed(root: str, latest: int, keep: int) -> list[str]:
    """The ``iter_N`` folders under ``root`` to delete after checkpoint ``latest`` was saved there with
    rule ``keep`` (0: only the latest stays; R: multiples of R stay too), oldest first."""
    tracked = _tracked(root)
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        match = _ITERATION.fullmatch(name)
        path = os.path.join(root, name)
        if match is None or os.path.islink(path) or not os.path.isdir(path):
            continue
        iteration = int(match.group(1))
        if iteration >= latest or iteration == tracked or (keep and iteration % keep == 0):
            continue
        out.append(name)
    return out


def _sweep_deleted(root: str) -> None:
    """Remove what earlier deletions that were killed left (``.del_iter_N``: not a checkpoint any more)."""
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if name.startswith(DELETE_PREFIX) and _ITERATION.fullmatch(name[len(DELETE_PREFIX):]) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


def prune(root: str, latest: int, keep: int) -> list[str]:
    """Delete :func:`doomed` folders (rename, then remove); returns their names. Raises OSError."""
    _sweep_deleted(root)
    gone = []
    for name in doomed(root, latest, keep):
        stale = os.path.join(root, ASIDE_PREFIX + name)  # a stale copy a repeated save set aside: first, or it
        if os.path.isdir(stale) and not os.path.islink(stale):  # would be renamed back once iter_N is gone
            shutil.rmtree(stale)
        aside = os.path.join(root, DELETE_PREFIX + name)
        os.rename(os.path.join(root, name), aside)  # from here on it is no checkpoint: whole or gone
        shutil.rmtree(aside)
        gone.append(name)
    return gone


def after_save(config, root: str, iteration) -> None:
    """Rank 0, after checkpoint ``iteration`` under ``root`` is complete and tracked: delete the older
    ones the flags do not keep (:func:`keep_every`). No collective; a failure is one warning."""
    keep = keep_every(config, root)
    if keep is None or iteration == "release" or (dist.is_initialized() and dist.get_rank() != 0):
        return
    try:
        gone = prune(root, int(iteration), keep)
    except OSError as err:
        print(f"WARNING: could not delete an old checkpoint under {root}: {err.strerror or err} ({err.filename}); "
              "it stays, training goes on", flush=True)
        return
    if gone:
        why = "non-persistent: only the latest is kept" if keep == 0 else f"--save-retain-interval {keep}"
        print_rank_0(f"  deleted {len(gone)} older checkpoint(s) under {root} ({why}): {', '.join(gone)}")
