"""What a training checkpoint leaves out: ``--no-save-optim`` (the optimizer state, its loss scaler
and the learning-rate schedule) and ``--no-save-rng`` (every rank's RNG states), in both formats.

Such a checkpoint resumes training only when told to do without the missing part: the optimizer
with ``--no-load-optim`` (fresh Adam moments; fp32 master weights taken from the loaded weights) or
``--finetune``, the RNG states with ``--no-load-rng`` or ``--finetune``; otherwise loading stops
with one line naming the flag (:class:`~megatron_lite.checkpoint.format.CheckpointError`, exit 2).
"""

from __future__ import annotations

import os

from .format import CheckpointError, atomic_save, iteration_dir, rng_file, with_checksums
from .rng import get_rng_states


def parts_to_save(optimizer, scheduler, config, state):
    """``(optimizer, scheduler, rng states)`` to write: None for what the flags leave out."""
    ck = config.checkpoint
    if ck.no_save_optim:
        optimizer = scheduler = None
    return optimizer, scheduler, None if ck.no_save_rng else get_rng_states(state.rng_tracker)


def save_rng(rng, path: str) -> None:
    """Write this rank's RNG states to ``path`` (nothing under --no-save-rng)."""
    if rng is not None:
        atomic_save(with_checksums(rng), path)


def missing_rng_error(root, iteration, rank: int, saved_world_size, world_size: int) -> CheckpointError:
    """The refusal of a torch-format checkpoint without this rank's RNG file."""
    folder = iteration_dir(root, iteration)
    if not os.path.isfile(rng_file(root, iteration, 0)):  # no rank's states: saved with --no-save-rng
        return CheckpointError(f"checkpoint {folder} has no RNG state (saved with --no-save-rng); pass "
                               "--no-load-rng or --finetune")
    return CheckpointError(f"checkpoint {folder} has no RNG state for rank {rank} (it was saved by "
                           f"{saved_world_size} ranks, this run has {world_size}); pass --no-load-rng")


def require_dist_rng(folder: str, path: str) -> str:
    """``path``, this rank's RNG file of torch_dist checkpoint ``folder``; refused when the checkpoint
    was saved without RNG states."""
    if not os.path.isdir(os.path.join(folder, "rng")):
        raise CheckpointError(f"checkpoint {folder} has no RNG state (saved with --no-save-rng); pass "
                              "--no-load-rng or --finetune")
    return path
