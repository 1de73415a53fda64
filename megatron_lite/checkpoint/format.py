"""The on-disk checkpoint format: folder layout, atomic writes, safe reads, and readers for tools.

Layout (Megatron's, so the folders look familiar)::

    <save>/latest_checkpointed_iteration.txt          iteration number, written last by rank 0
    <save>/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   one per TP x PP rank
    <save>/iter_0000100/rng/rank_{global_rank:05d}.pt                  one per rank

With expert parallelism the model folder is ``mp_rank_{tp:02d}_{pp:03d}_{ep:03d}`` (expert weights
differ across EP ranks).

Every file is written under a temporary name and renamed into place, so a reader never sees half a
file. Files are read with ``torch.load(weights_only=True)``: only tensors and plain Python values,
so a checkpoint cannot run code when it is loaded.
"""

from __future__ import annotations

import os

import torch

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
FORMAT_VERSION = 1

# Config fields that decide parameter shapes: named in the message when shapes or names differ.
ARCH_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "padded_vocab_size", "vocab_size", "max_position_embeddings", "position_embedding_type", "normalization",
    "swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights",
)


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit this run; the message says which and why."""


# ---------------------------------------------------------------------------------------------
# Paths.


def iteration_dir(root: str, iteration: int | str) -> str:
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return os.path.join(root, name)


def model_file(root: str, iteration, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    folder = f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" + ("" if ep_rank is None else f"_{ep_rank:03d}")
    return os.path.join(iteration_dir(root, iteration), folder, MODEL_FILENAME)


def rng_file(root: str, iteration, rank: int) -> str:
    return os.path.join(iteration_dir(root, iteration), "rng", f"rank_{rank:05d}.pt")


def read_tracker(root: str) -> int | str | None:
    """The iteration in ``<root>/latest_checkpointed_iteration.txt`` (``"release"`` allowed), or None."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(
            f"{path} should hold an iteration number but holds {text[:40]!r}; fix or delete it"
        ) from None


# ---------------------------------------------------------------------------------------------
# Atomic writes and safe reads.


def atomic_save(obj, path: str) -> None:
    """``torch.save`` under a temporary name, then rename: the file is complete or absent."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` (flushed to disk) under a temporary name, then rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_file(path: str, what: str = "checkpoint file") -> dict:
    """``torch.load(weights_only=True)`` to CPU; one-line CheckpointError if missing or corrupt."""
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{what} {path} is missing; the checkpoint is incomplete (was the save interrupted?) "
            "- point --load at a complete checkpoint"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, ... : one clear line
        raise CheckpointError(
            f"{what} {path} is unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "it is truncated or corrupt - point --load at another checkpoint"
        ) from None


# ---------------------------------------------------------------------------------------------
# What a model file records about its parameters.


def param_meta(module) -> dict:
    """``{name: {"partition_dim", "partition_stride"}}`` of the tensor-parallel parameters of ``module``:
    what a reader needs to :func:`~megatron_lite.parallel.tensor.unshard` them (replicated ones are absent)."""
    return {
        name: {"partition_dim": int(p.partition_dim), "partition_stride": int(getattr(p, "partition_stride", 1))}
        for name, p in module.named_parameters()
        if getattr(p, "tensor_model_parallel", False)
    }


# ---------------------------------------------------------------------------------------------
# Reading checkpoints outside training (tools/generate.py, converters).


def find_model_files(path: str) -> dict[tuple, str]:
    """{(tp_rank, pp_rank[, ep_rank]): file} of a save folder (its latest iteration) or an ``iter_*`` folder."""
    folder = path
    if os.path.isfile(os.path.join(path, TRACKER_FILENAME)):
        folder = iteration_dir(path, read_tracker(path))
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    files = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("mp_rank_") and os.path.isfile(os.path.join(folder, name, MODEL_FILENAME)):
            files[tuple(int(x) for x in name[len("mp_rank_"):].split("_"))] = os.path.join(folder, name, MODEL_FILENAME)
    if not files:
        raise CheckpointError(f"no mp_rank_*/{MODEL_FILENAME} under {folder}; is it a megatron_lite checkpoint?")
    return files


def read_model_file(path: str) -> dict:
    """The whole payload of one ``model_optim_rng.pt`` (CPU tensors); CheckpointError if missing/corrupt."""
    return load_file(path)


def checkpoint_config(path: str) -> dict:
    """The flat config dict a checkpoint was saved with.

    ``path`` is a save folder (its latest iteration is used), an ``iter_*`` folder, or a model file.
    The dict also holds ``iteration``, ``tp_size``, ``pp_size`` and ``vpp_size`` of the checkpoint.
    """
    if os.path.isfile(path):
        file = path
    else:
        files = find_model_files(path)
        file = files[min(files)]
    ckpt = load_file(file)
    out = dict(ckpt["config"])
    for key in ("iteration", "tp_size", "pp_size", "vpp_size"):
        out.setdefault(key, ckpt.get(key))
    return out
