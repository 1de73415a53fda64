"""On-disk cache for dataset index arrays (GPT sample indices, blending indices, BERT mappings).

Building the index of a large dataset takes seconds to minutes; every rank of every run needs the
same arrays.  They are saved as ``.npy`` files in a folder whose name carries a hash of everything
that determines them (the ``description`` dict: data prefix, split range, sample count, sequence
length, seed, class, ...).  So a changed flag gives a new folder, never a stale index.

Concurrency: many ranks (or many jobs) may start at once.  One process takes an exclusive
``fcntl`` lock on ``<folder>.lock``, builds the arrays into a temporary folder and renames it into
place (atomic on POSIX); the others block on the lock and then load what it wrote.  A later run
finds the folder and loads it memory-mapped without taking the lock.  ``description.json`` inside
the folder records what the arrays are, for humans.

Note: ``fcntl`` locks work on local disks and on most (not all) network file systems.  On a file
system without working locks, build the cache once (e.g. one rank, or a small launch) first.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable

import numpy as np

from megatron_lite.data.indexed_dataset import DataFileError

DESCRIPTION_FILE = "description.json"


def description_hash(description: dict) -> str:
    """A stable hex digest of a JSON-serialisable description (key order does not matter)."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def cache_folder(cache_dir: str, description: dict) -> str:
    """Folder that holds (or will hold) the arrays for ``description`` under ``cache_dir``."""
    name = f"{description.get('class', 'index')}-{description_hash(description)}"
    return os.path.join(cache_dir, name)


def _load(folder: str, names: list[str]) -> dict[str, np.ndarray] | None:
    """The cached arrays, memory-mapped, or None when the folder is missing or incomplete."""
    if not os.path.isfile(os.path.join(folder, DESCRIPTION_FILE)):
        return None
    paths = {name: os.path.join(folder, f"{name}.npy") for name in names}
    if not all(os.path.isfile(p) for p in paths.values()):
        return None
    arrays = {}
    for name, path in paths.items():
        try:
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError, OSError) as err:  # cut short or overwritten after it was written
            raise DataFileError(f"{path}: damaged index cache ({err}); delete {folder} and it is built "
                                f"again (--data-cache-path)") from None
    return arrays


def _write(folder: str, description: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write arrays + description into a temporary sibling folder, then rename it into place."""
    parent = os.path.dirname(folder)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".tmp-", dir=parent)
    try:
        for name, array in arrays.items():
            np.save(os.path.join(tmp, f"{name}.npy"), np.ascontiguousarray(array), allow_pickle=False)
        with open(os.path.join(tmp, DESCRIPTION_FILE), "w") as f:
            json.dump(description, f, indent=2, sort_keys=True, default=str)
        # mkdtemp makes the folder private (0700): give it the permissions any new folder gets, so the
        # other users and jobs that share this data folder can load the cache instead of failing on it
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        if os.path.isdir(folder):  # an incomplete leftover (no description.json): replace it
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_or_build(cache_dir: str | None, description: dict, names: list[str],
                  build: Callable[[], dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], str]:
    """Return the arrays named ``names`` for ``description``, building (and caching) them if needed.

    ``build()`` must return a dict with exactly those names.  With ``cache_dir=None`` nothing is
    written and the arrays are built in memory.  Returns (arrays, how) where ``how`` is one of
    "memory", "built", "loaded" (for the startup log).
    """
    if cache_dir is None:
        return build(), "memory"
    folder = cache_folder(cache_dir, description)
    cached = _load(folder, names)
    if cached is not None:
        return cached, "loaded"
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock_file = open(folder + ".lock", "a")
    except OSError as err:
        raise DataFileError(f"--data-cache-path {cache_dir}: cannot write the index cache there ({err}); "
                            f"pass a writable --data-cache-path") from err
    with lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # blocks while another process builds
        try:
            cached = _load(folder, names)  # someone else may have built it while we waited
            if cached is not None:
                return cached, "loaded"
            arrays = build()
            missing = set(names) - set(arrays)
            if missing:
                raise KeyError(f"index builder did not return arrays {sorted(missing)}")
            try:
                _write(folder, description, {name: arrays[name] for name in names})
            except OSError as err:  # a full disk or quota: nothing half-written is left (see _write)
                raise DataFileError(f"--data-cache-path {cache_dir}: cannot write the index cache there ({err}); "
                                    f"free space or pass another --data-cache-path") from None
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    loaded = _load(folder, names)
    return (loaded if loaded is not None else arrays), "built"


def lengths_fingerprint(sequence_lengths) -> str:
    """A digest of a dataset's sequence lengths, for cache keys: a dataset rewritten under the
    same name (re-preprocessed) then gets a new cache instead of a stale one."""
    return hashlib.sha1(np.ascontiguousarray(sequence_lengths).view(np.uint8)).hexdigest()
