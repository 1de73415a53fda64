"""The model flags a checkpoint was saved with: resuming refuses other values, and
``--use-checkpoint-args`` takes them from the checkpoint.

The flags are listed once, in :data:`megatron_lite.config.ARCHITECTURE_FLAGS`. Those that decide
parameter shapes would fail the load anyway (the message names them); the others (``--openai-gelu``,
``--rotary-base``, ``--norm-epsilon``, the router's top-k, ...) keep every shape, so without this
check a resumed run would silently go on as another model. ``--finetune`` skips the check: there a
change can be deliberate.
"""

from __future__ import annotations

from ..config import ARCHITECTURE_FLAGS, SECTIONS
from .format import (
    ARCH_FIELDS,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_config,
    iteration_dir,
    read_tracker,
)

RESUME_FIELDS = ARCHITECTURE_FLAGS + ("vocab_size",)  # the padded vocabulary may differ: it is re-padded


def arch_differences(saved_config: dict, config, fields=ARCH_FIELDS) -> list[str]:
    """``"hidden-size 32 (this run 64)"`` for each of ``fields`` whose saved value differs from the run's."""
    ours = config.flat()
    return [f"{key.replace('_', '-')} {saved_config[key]} (this run {ours[key]})"
            for key in fields if key in saved_config and key in ours and saved_config[key] != ours[key]]


def check_architecture(where: str, saved_config: dict, config, release: bool = False) -> None:
    """Refuse (CheckpointError, one line) a resume whose model flags differ from the checkpoint's;
    nothing with --finetune. The padded vocabulary may differ (loading re-pads it); the vocabulary
    itself too for a ``release`` checkpoint (a converted model a new run starts from, e.g. with
    --mock-data, whose NullTokenizer adds an end-of-document id)."""
    if config.checkpoint.finetune:
        return
    arch = arch_differences(saved_config, config, ARCHITECTURE_FLAGS if release else RESUME_FIELDS)
    if arch:
        raise CheckpointError(
            f"checkpoint {where} was saved with {', '.join(arch)}; match the model flags, pass --use-checkpoint-args "
            "to take them from the checkpoint, or --finetune to change them on purpose")


def saved_config(root: str) -> tuple[str, dict]:
    """(iteration folder, flat config) of the latest checkpoint under ``root`` (either format)."""
    from .dist_read import is_dist_folder, read_common

    iteration = read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"--use-checkpoint-args: --load {root} holds no checkpoint (no {TRACKER_FILENAME}); "
                              "drop the flag or fix --load")
    folder = iteration_dir(root, iteration)
    return folder, dict(read_common(folder)["config"] if is_dist_folder(folder) else checkpoint_config(folder))


def apply_checkpoint_args(config) -> list[str]:
    """Set every architecture flag of ``config`` (before it is finalized) to the value the checkpoint
    at ``--load`` was saved with; returns what changed, as ``"hidden-size 32 (was 64)"``."""
    if config.checkpoint.load is None:
        raise CheckpointError("--use-checkpoint-args needs --load (the checkpoint to take the model flags from)")
    _, saved = saved_config(config.checkpoint.load)
    changed = []
    for section in SECTIONS + tuple(config.extra_sections):
        values = getattr(config, section)
        for key in ARCHITECTURE_FLAGS:
            if key in saved and hasattr(values, key) and getattr(values, key) != saved[key]:
                changed.append(f"{key.replace('_', '-')} {saved[key]} (was {getattr(values, key)})")
                setattr(values, key, saved[key])
    return changed
