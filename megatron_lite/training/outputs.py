"""Check, before any training step, that every folder the run will write to can be written.

An unwritable ``--save`` would otherwise be discovered at the first save, after the training it was
meant to protect; a ``--tensorboard-dir`` that names a file would crash the logger. Each location is
created if missing and probed with a temporary file (removed again), on every rank, before the
process group exists, so a bad location is one ConfigError (exit 2) naming the flag.
"""

from __future__ import annotations

import os
import tempfile

from ..config import Config, ConfigError
from ..console import print_rank_0
from ..files import replaced_whole

DEFAULT_PROFILE_DIR = "profile"  # --profile --use-pytorch-profiler's trace folder without --tensorboard-dir
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"  # the checkpoint tracker (checkpoint/format.py)


def output_locations(config: Config) -> list[tuple[str, str]]:
    """(flag, folder) of every output folder the flags name."""
    log = config.logging
    profile = log.profile and log.use_pytorch_profiler and not log.tensorboard_dir  # the trace's default folder
    named = [("--save", config.checkpoint.save), ("--tensorboard-dir", log.tensorboard_dir),
             ("--data-cache-path", config.data.data_cache_path),
             ("--wandb-save-dir" if log.wandb_save_dir else "--wandb-project's folder",
              wandb_folder(config) if log.wandb_project else None),
             ("--profile (no --tensorboard-dir) trace folder", DEFAULT_PROFILE_DIR if profile else None)]
    return [(flag, path) for flag, path in named if path]


def wandb_folder(config: Config) -> str:
    """Where W&B keeps its local files: --wandb-save-dir, else <save>/wandb, else ./wandb."""
    save = config.checkpoint.save
    return config.logging.wandb_save_dir or (os.path.join(save, "wandb") if save else os.path.abspath("wandb"))


def _probe(folder: str) -> None:
    """Create ``folder`` if needed and write (then remove) a file there; OSError if impossible."""
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_probe."):
        pass


def check_writable(flag: str, path: str) -> None:
    """Create ``path`` if needed and write (then remove) a probe file there; ConfigError if impossible."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a folder; pick a folder")
    try:
        _probe(path)
    except OSError as err:
        raise ConfigError(f"{flag} {path} is not writable ({err.strerror or err}); pick a folder you can "
                          "write to") from None


def check_output_file(flag: str, path: str) -> None:
    """A file ``path`` can be written: not a folder, its folder created if needed and writable
    (checked before the work whose result it holds, not after)."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a folder; name a file")
    folder = os.path.dirname(os.path.abspath(path))
    above = folder
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ConfigError(f"{flag} {path}: {above} is a file, not a folder; pick another path")
    try:
        _probe(folder)
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot write in {folder} ({err.strerror or err}); pick another "
                          "path") from None


def save_figure(fig, path: str, dpi: int = 120, flag: str | None = None) -> None:
    """Write a matplotlib figure whole to ``path`` (a temporary name, then a rename) in the format its
    extension names (.svg, .pdf, ...; PNG where matplotlib writes no such format).

    A write that fails (a full disk, a folder removed meanwhile) or is interrupted removes the
    temporary file and leaves ``path`` as it was; the OSError becomes a ConfigError naming ``flag``
    and ``path`` when ``flag`` is given (the tools' one-line exit 2), else it is re-raised."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    fmt = ext if ext in fig.canvas.get_supported_filetypes() else "png"
    try:
        with replaced_whole(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format=fmt)
    except OSError as err:
        if flag is None:
            raise
        raise ConfigError(f"{flag} {path}: could not write the image ({err.strerror or err}); nothing was "
                          "written: free some space or pick another path") from None


def check_output_locations(config: Config) -> None:
    """Every output folder of the run is writable (and --save's tracker is not a folder)."""
    for flag, path in output_locations(config):
        check_writable(flag, path)
    if config.training.result_rejected_tracker_filename:  # rewritten whole by rank 0 after a rejected result
        check_output_file("--result-rejected-tracker-filename", config.training.result_rejected_tracker_filename)
    save = config.checkpoint.save
    if save and os.path.isdir(os.path.join(save, TRACKER_FILENAME)):
        raise ConfigError(f"--save {save}: {TRACKER_FILENAME} there is a folder; remove it")
    warning = save_taken_over_warning(save, config.checkpoint.load)
    if warning:
        print_rank_0(warning)


def save_taken_over_warning(save: str | None, load: str | None) -> str | None:
    """A start-up warning when --save holds another run's checkpoints and this run does not resume them
    (no --load of that folder): its saves take the folder's tracker over, or None."""
    tracker = os.path.join(save, TRACKER_FILENAME) if save else None
    if tracker is None or not os.path.isfile(tracker):
        return None
    if load and os.path.realpath(load) == os.path.realpath(save):
        return None
    try:
        with open(tracker, "rb") as f:
            latest = f.read(64).decode("ascii", "replace").strip()
    except OSError:
        latest = "?"
    resumed = f"--load {load}" if load else "no --load"
    return (f"WARNING: --save {save} already holds checkpoints (latest: {latest}) that this run does not resume "
            f"({resumed}): its saves will replace that tracker; pass --load {save} to continue them, or pick "
            "another --save")


def interrupted_note(save: str | None, saved_at: int | None, iteration: int, async_save: bool) -> str:
    """Where a Ctrl-C stopped a run after ``iteration`` steps, and the checkpoint to resume from
    (``saved_at``: the iteration --save holds, when known; an --async-save may still have been writing it)."""
    if not save:
        kept = "nothing is saved (no --save)"
    elif saved_at is None:
        kept = f"no checkpoint in {save} from this run"
    elif async_save:
        kept = f"resume with --load {save} (its tracker names the last complete checkpoint)"
    else:
        kept = f"the last checkpoint is iteration {saved_at} in {save} (resume with --load {save})"
    return f"stopped in iteration {iteration + 1}; {kept}"
