"""Checkpoints: the on-disk format (format.py), training save/resume (training.py), merging any
TP x PP x EP layout into one single-process model for tools (merge.py), writing any layout
(reshard.py, reshard_optim.py, layout.py), Hugging Face formats (hf.py, hf_mixtral.py, hf_bert.py,
hf_io.py; a whole Hugging Face folder read or written: hf_folder.py), the converter's loader/saver plugins (convert.py), and the sharded ``torch_dist`` format
that loads at any layout (boxes.py, dist.py, dist_read.py, dist_save.py)."""

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
from .hf_folder import load_hf, save_hf
from .merge import load_bert_checkpoint, load_gpt_checkpoint, merge_checkpoint, model_config_from_saved
from .reshard import ModelBundle, TargetLayout, load_megatron, save_megatron
from .rng import get_rng_states
from .training import load_checkpoint, save_checkpoint, set_rng_states

__all__ = [
    "FORMAT_VERSION", "MODEL_FILENAME", "TRACKER_FILENAME", "CheckpointError", "ModelBundle", "TargetLayout",
    "checkpoint_config", "load_hf", "load_megatron", "save_hf", "save_megatron",
    "find_model_files", "get_rng_states", "iteration_dir", "load_bert_checkpoint", "load_checkpoint",
    "load_gpt_checkpoint",
    "merge_checkpoint", "model_config_from_saved", "model_file", "param_meta", "read_model_file",
    "read_tracker", "rng_file", "save_checkpoint", "set_rng_states",
]
