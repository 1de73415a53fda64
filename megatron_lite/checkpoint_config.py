"""The ``checkpoint`` section of :class:`~megatron_lite.config.Config`: saving, loading, formats, and which
checkpoints are kept (kept apart from config.py, which holds the other sections, to keep files small)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import ConfigError


@dataclass
class CheckpointConfig:
    save: str | None = None
    """Folder to save checkpoints to."""
    load: str | None = None
    """Folder to load a checkpoint from."""
    save_interval: int | None = field(default=None, metadata={"aliases": ("--persistent-save-interval",)})
    """Save every this many steps (0: no periodic save, only the final one)."""
    no_load_optim: bool = field(default=False, metadata={"aliases": ("--disable-load-optim",)})  # newer Megatron-LM's spelling
    """Do not load optimizer state."""
    no_load_rng: bool = field(default=False, metadata={"aliases": ("--disable-load-rng",)})  # newer Megatron-LM's spelling
    """Do not load RNG states."""
    finetune: bool = False
    """Load only the model weights and start at iteration 0."""
    pretrained_checkpoint: str | None = None
    """While --load has no checkpoint: load the model weights from here (any format and layout) and start at iteration 0."""
    ckpt_format: str = "torch"
    """Format to save in: torch (one file per TP x PP rank) or torch_dist (sharded, loads at any layout)."""
    auto_detect_ckpt_format: bool = False
    """Load the checkpoint at --load in whichever format it is."""
    async_save: bool = False
    """Write torch_dist checkpoints in the background while training goes on."""
    use_checkpoint_args: bool = False
    """Take the model flags (architecture, see ARCHITECTURE_FLAGS; --make-vocab-size-divisible-by, NullTokenizer's --vocab-size, and --seq-length when left out) from the checkpoint at --load."""
    no_save_optim: bool = field(default=False, metadata={"aliases": ("--disable-save-optim",)})  # newer Megatron-LM's spelling
    """Do not save the optimizer state (nor its loss scaler and learning-rate schedule); resuming from such a checkpoint needs --no-load-optim or --finetune."""
    no_save_rng: bool = field(default=False, metadata={"aliases": ("--disable-save-rng",)})  # newer Megatron-LM's spelling
    """Do not save the RNG states; resuming from such a checkpoint needs --no-load-rng or --finetune."""
    no_ckpt_fully_parallel_save: bool = False
    """Accepted for Megatron scripts: it changes nothing, torch_dist weights are always written by data-parallel rank 0 (distributed-optimizer shards by every rank)."""
    dist_ckpt_optim_fully_reshardable: bool = False
    """Accepted for Megatron scripts: it changes nothing, torch_dist optimizer state always reshards over TP, PP and DP."""
    disable_msc: bool = False
    """Accepted for Megatron scripts: it changes nothing, the Multi-Storage Client is never used."""
    ckpt_step: int | None = None
    """Load this iteration from --load instead of the one its tracker file names."""
    exit_on_missing_checkpoint: bool = False
    """With --load: stop (exit code 2) when it holds no checkpoint, instead of training from scratch."""
    no_initialization: bool = False
    """Skip drawing the initial weights (a checkpoint at --load or --pretrained-checkpoint overwrites them); refused when there is none."""
    save_retain_interval: int | None = None
    """Delete older persistent checkpoints after each save, except iterations that are multiples of this (a multiple of --save-interval) and the latest."""
    non_persistent_save_interval: int | None = None
    """Every N steps, also save a non-persistent checkpoint (only the latest is kept); needs --non-persistent-ckpt-type global."""
    non_persistent_ckpt_type: str | None = None
    """Kind of non-persistent checkpoint: global (a checkpoint in its own folder, see --non-persistent-global-ckpt-dir); --load resumes from it when it is newer than the persistent one."""
    non_persistent_global_ckpt_dir: str | None = None
    """Folder of the global non-persistent checkpoints (default: <save>/non_persistent, read from <load>/non_persistent)."""


NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's: <save>/non_persistent unless the folder is given


def non_persistent_dir(cp, base: str | None) -> str | None:
    """The global non-persistent checkpoints' folder: --non-persistent-global-ckpt-dir, else ``base``
    (--save when saving, --load when loading) + ``/non_persistent``; None without either."""
    if cp.non_persistent_global_ckpt_dir:
        return cp.non_persistent_global_ckpt_dir
    return None if base is None else os.path.join(base, NON_PERSISTENT_SUBDIR)


def _positive(value, flag: str) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{flag} must be at least 1, got {value}")


def check_checkpoint_management(cp) -> None:
    """One line (ConfigError) for a combination of the checkpoint-management flags that cannot work:
    --save-retain-interval, the non-persistent checkpoints, --ckpt-step, --exit-on-missing-checkpoint."""
    _positive(cp.save_retain_interval, "--save-retain-interval")
    _positive(cp.non_persistent_save_interval, "--non-persistent-save-interval")
    if cp.save_retain_interval is not None:
        if cp.save is None or not cp.save_interval:
            raise ConfigError(f"--save-retain-interval {cp.save_retain_interval} thins the periodic checkpoints of "
                              "--save: add --save DIR and --save-interval N (it must be a multiple of N)")
        if cp.save_retain_interval % cp.save_interval:
            raise ConfigError(f"--save-retain-interval {cp.save_retain_interval} must be a multiple of --save-interval "
                              f"{cp.save_interval} (as in Megatron-LM): otherwise no periodic checkpoint would be kept")
    if cp.non_persistent_ckpt_type in ("local", "in_memory"):
        raise ConfigError(f"--non-persistent-ckpt-type {cp.non_persistent_ckpt_type} keeps checkpoints on node-local "
                          "storage through NVIDIA's resiliency package (nvidia-resiliency-ext), which megatron_lite does "
                          "not use; use --non-persistent-ckpt-type global")
    if cp.non_persistent_ckpt_type not in (None, "global"):
        raise ConfigError(f"--non-persistent-ckpt-type {cp.non_persistent_ckpt_type}: the only type is global")
    if cp.non_persistent_save_interval is not None:
        if cp.non_persistent_ckpt_type != "global":
            raise ConfigError("--non-persistent-save-interval needs --non-persistent-ckpt-type global (as in "
                              "Megatron-LM, which has no default type)")
        if cp.save is None:
            raise ConfigError("--non-persistent-save-interval needs --save (the persistent checkpoints, and by default "
                              "the folder above <save>/non_persistent)")
    if cp.non_persistent_global_ckpt_dir and cp.non_persistent_ckpt_type != "global":
        raise ConfigError("--non-persistent-global-ckpt-dir needs --non-persistent-ckpt-type global")
    for flag, folder in (("--save", cp.save), ("--load", cp.load)):  # only its latest is kept: never theirs
        if cp.non_persistent_global_ckpt_dir and folder and os.path.realpath(folder) == os.path.realpath(
                cp.non_persistent_global_ckpt_dir):
            raise ConfigError(f"--non-persistent-global-ckpt-dir {cp.non_persistent_global_ckpt_dir} is the {flag} "
                              "folder, whose older checkpoints its pruning would delete; give it a folder of its own "
                              "(default: <save>/non_persistent)")
    if cp.ckpt_step is not None:
        if cp.load is None:
            raise ConfigError(f"--ckpt-step {cp.ckpt_step} picks an iteration of --load: add --load DIR")
        if cp.ckpt_step < 0:
            raise ConfigError(f"--ckpt-step must not be negative, got {cp.ckpt_step}")
    if cp.exit_on_missing_checkpoint and cp.load is None:
        raise ConfigError("--exit-on-missing-checkpoint needs --load (the folder that must hold a checkpoint)")
