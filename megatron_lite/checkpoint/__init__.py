"""Checkpoints: the on-disk format (format.py), training save/resume (training.py), and merging any
TP x PP layout into one single-process model for tools (merge.py)."""

from .format import (
    FORMAT_VERSION,
    MODEL_FILENAME,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_config,
    find_model_files,
    iteration_dir,
    model_file,
    param_meta,
    read_model_file,
    read_tracker,
    rng_file,
)
from .merge import load_gpt_checkpoint, merge_checkpoint, model_config_from_saved
from .training import get_rng_states, load_checkpoint, save_checkpoint, set_rng_states

__all__ = [
    "FORMAT_VERSION", "MODEL_FILENAME", "TRACKER_FILENAME", "CheckpointError", "checkpoint_config",
    "find_model_files", "get_rng_states", "iteration_dir", "load_checkpoint", "load_gpt_checkpoint",
    "merge_checkpoint", "model_config_from_saved", "model_file", "param_meta", "read_model_file",
    "read_tracker", "rng_file", "save_checkpoint", "set_rng_states",
]
