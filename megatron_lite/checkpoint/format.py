"""The on-disk checkpoint format: folder layout, atomic writes, safe reads, and readers for tools.

Layout (Megatron's, so the folders look familiar)::

    <save>/latest_checkpointed_iteration.txt          iteration number, written last by rank 0
    <save>/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   one per TP x PP rank
    <save>/iter_0000100/rng/rank_{global_rank:05d}.pt                  one per rank

With expert parallelism the model folder is ``mp_rank_{tp:02d}_{pp:03d}_{ep:03d}`` (expert weights
differ across EP ranks).

Every file is written under a temporary name and renamed into place, so a reader never sees half a
file. Files are read with ``torch.load(weights_only=True)``: only tensors and plain Python values,
so a checkpoint cannot run code when it is loaded. Each file stores a CRC-32 of every tensor it
holds, checked on every load, so damaged bytes are an error naming the file and tensor instead of a
run that trains on garbage.
"""

from __future__ import annotations

import errno
import os
import zlib

import torch
import torch.distributed as dist

from ..arch_flags import ARCHITECTURE_FLAGS
from ..errors import raised_on_every_rank
from ..files import replaced_whole

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
PROGRESS_FILENAME = "progress.txt"  # --log-progress, in the --save folder (training/progress.py)
MODEL_FILENAME = "model_optim_rng.pt"
DIST_COMMON_FILENAME = "common.pt"  # a torch_dist iteration folder's rank-0 file (see checkpoint/dist_read.py)
FORMAT_VERSION = 1

# Config fields that describe the model a checkpoint holds (the vocabulary besides the flags):
# named in the message when shapes or names differ.
ARCH_FIELDS = ARCHITECTURE_FLAGS + ("make_vocab_size_divisible_by", "padded_vocab_size", "vocab_size")

# Tensors whose rows are the (padded) vocabulary: the padding depends on the TP size, so a checkpoint
# read at another TP size is re-padded (real rows kept, padded rows zero; they never reach the loss).
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")  # bias: BERT


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit this run; the message says which and why."""


# The flags naming tokenizer files: a checkpoint records them as absolute paths (saved_config).
TOKENIZER_FILE_FLAGS = ("vocab_file", "merge_file", "tokenizer_model")


def saved_config(config) -> dict:
    """The flat config a checkpoint records: the run's flags, with each file they name that exists (a
    tokenizer file, a ``--spec`` .py file) by its absolute path, so that tools/generate.py, the server,
    lm-eval and the converter find it from any folder (a run given ``--tokenizer-model data/spm.model``
    or ``--spec my_specs.py NAME`` named it relative to where it started)."""
    flat = config.flat()
    for key in TOKENIZER_FILE_FLAGS:
        if isinstance(flat.get(key), str) and os.path.exists(flat[key]):
            flat[key] = os.path.abspath(flat[key])
    spec = flat.get("spec")
    if isinstance(spec, (list, tuple)) and len(spec) == 2 and os.path.isfile(spec[0]):
        flat["spec"] = [os.path.abspath(spec[0]), spec[1]]
    return flat


def check_optimizer_name(where: str, saved: str | None, used: str) -> None:
    """Optimizer state of another ``--optimizer`` (``saved``; None: unknown) does not fit this run's: refused."""
    if saved not in (None, used):
        raise CheckpointError(f"checkpoint {where} holds {saved} state, this run uses --optimizer {used}; "
                              "match --optimizer or pass --no-load-optim")


def restore_scheduler(scheduler, saved: dict, where: str) -> None:
    """``scheduler.load_state_dict(saved)``; a schedule that differs from the flags is a CheckpointError."""
    from ..errors import ConfigError

    try:
        scheduler.load_state_dict(saved)
    except ConfigError as err:
        raise CheckpointError(f"checkpoint {where}: {err}") from None


# ---------------------------------------------------------------------------------------------
# Paths.


def iteration_dir(root: str, iteration: int | str) -> str:
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return os.path.join(root, name)


ASIDE_PREFIX = ".old_"  # + iter_XXXXXXX: the folder a save replacing it keeps aside meanwhile


def aside_dir(root: str, iteration: int | str) -> str:
    """Where a save repeating iteration N keeps the old ``iter_N`` while it renames the new one in."""
    return os.path.join(root, ASIDE_PREFIX + os.path.basename(iteration_dir(root, iteration)))


TEMP_PREFIX = ".tmp_"  # + iter_XXXXXXX: the folder a save writes into before renaming it into place


def temp_dir(root: str, iteration: int | str) -> str:
    """Where a save of iteration N (training or the converter) writes before renaming it to ``iter_N``."""
    return os.path.join(root, TEMP_PREFIX + os.path.basename(iteration_dir(root, iteration)))


def restore_aside(root: str, iteration: int | str) -> None:
    """A save replacing ``iter_N`` that died between its renames left the old folder as ``.old_iter_N``
    and none under the real name (which the tracker may name): rename it back."""
    final, aside = iteration_dir(root, iteration), aside_dir(root, iteration)
    if os.path.lexists(final) or not os.path.isdir(aside):
        return
    try:
        os.rename(aside, final)
    except OSError as err:
        if not os.path.isdir(final):  # not another rank restoring it at the same moment
            raise CheckpointError(f"{final} is missing and {aside} holds it (a save of that iteration stopped while "
                                  f"replacing it) but renaming it back failed ({err.strerror or err}); rename {aside} "
                                  f"to {final}") from None


def model_file(root: str, iteration, tp_rank: int, pp_rank: int, ep_rank: int | None = None,
               etp_rank: int | None = None) -> str:
    """``mp_rank_TT_PPP[_EEE[_XX]]``: ``XX`` is the expert-tensor rank of a folded expert grid."""
    folder = f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" + ("" if ep_rank is None else f"_{ep_rank:03d}")
    folder += "" if etp_rank is None else f"_{etp_rank:02d}"
    return os.path.join(iteration_dir(root, iteration), folder, MODEL_FILENAME)


def rng_file(root: str, iteration, rank: int) -> str:
    return os.path.join(iteration_dir(root, iteration), "rng", f"rank_{rank:05d}.pt")


def read_tracker(root: str) -> int | str | None:
    """The iteration in ``<root>/latest_checkpointed_iteration.txt`` (``"release"`` allowed), or None
    when there is no such file. Anything else there (a folder, binary bytes, not a number) is a
    CheckpointError: it is never mistaken for "no checkpoint". A save that died while replacing the
    folder it names has its old folder renamed back (:func:`restore_aside`)."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is not a file (a folder or a broken link); remove it or write the "
                              "iteration number into it")
    try:
        with open(path, "rb") as f:
            text = f.read(256).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable ({type(err).__name__}); write the iteration number into it "
                              "or delete it") from None
    if text == "release":
        iteration = text
    else:
        try:
            iteration = int(text)
        except ValueError:
            iteration = -1
        if iteration < 0:  # iter_-000003 does not exist: the tracker is what is wrong
            raise CheckpointError(
                f"{path} should hold an iteration number (0 or more) but holds {text[:40]!r}; fix or delete it"
            )
    restore_aside(root, iteration)
    if not os.path.isdir(iteration_dir(root, iteration)):  # never reported as another format or a partial save
        held = iteration_folders(root)
        raise CheckpointError(f"{path} names iteration {iteration} but {iteration_dir(root, iteration)} does not exist; "
                              + (f"write the iteration of a checkpoint there into it (newest: {held[-1]})" if held
                                 else "there is no checkpoint in that folder: point --load at the one holding yours"))
    return iteration


def is_iteration_folder(folder: str) -> bool:
    """True when ``folder`` is one checkpoint (it holds a model file or a torch_dist checkpoint)."""
    if not os.path.isdir(folder):
        return False
    return os.path.isfile(os.path.join(folder, DIST_COMMON_FILENAME)) or any(
        os.path.isfile(os.path.join(folder, sub, MODEL_FILENAME)) for sub in os.listdir(folder))


def iteration_folders(root: str) -> list[str]:
    """The ``iter_*`` and ``release`` folders under ``root`` holding at least one model file or a
    torch_dist checkpoint (sorted;
    empty if ``root`` is not a folder). A folder without one is the leftover of a save killed before
    any model file was complete, not a checkpoint."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if (name.startswith("iter_") or name == "release") and is_iteration_folder(folder):
            out.append(name)
    return out


# ---------------------------------------------------------------------------------------------
# Atomic writes and safe reads.


def atomic_save(obj, path: str) -> None:
    """``torch.save`` under a temporary name, then rename: the file is complete or absent."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with replaced_whole(path) as tmp:
        try:
            torch.save(obj, tmp)
        except RuntimeError as err:  # torch.save reports a failed write (a full disk) as a RuntimeError
            reason = str(err).strip().splitlines()[0][:120] if str(err).strip() else "RuntimeError"
            raise OSError(errno.EIO, f"write failed ({reason}); is the disk full?", path) from None


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` (flushed to disk) under a temporary name, then rename."""
    with replaced_whole(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def load_file(path: str, what: str = "checkpoint file", keys: tuple[str, ...] = ()) -> dict:
    """``torch.load(weights_only=True)`` to CPU; one-line CheckpointError if missing or corrupt, if it
    is not a dict holding ``keys``, or if a tensor fails the checksum it was saved with."""
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{what} {path} is missing; the checkpoint is incomplete (was the save interrupted?) "
            "- point --load at a complete checkpoint"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, ... : one clear line
        raise CheckpointError(
            f"{what} {path} is unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "it is truncated or corrupt - point --load at another checkpoint"
        ) from None
    missing = [k for k in keys if k not in obj] if isinstance(obj, dict) else list(keys)
    if not isinstance(obj, dict) or missing:
        held = f"a dict without {', '.join(missing)}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
        raise CheckpointError(f"{what} {path} is not a megatron_lite checkpoint file (it holds {held}); "
                              "point --load at another checkpoint")
    verify_checksums(obj, path, what)
    return obj


# ---------------------------------------------------------------------------------------------
# Checksums: one CRC-32 per tensor, stored in the file beside the tensors, checked on every load.

CHECKSUMS_KEY = "tensor_checksums"


def _tensors(obj, prefix=""):
    """(path, tensor) of every tensor in nested dicts/lists/tuples, in a deterministic order."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            if key != CHECKSUMS_KEY:
                yield from _tensors(obj[key], f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{prefix}/{i}" if prefix else str(i))


def tensor_crc(tensor: torch.Tensor) -> int:
    """CRC-32 of the bytes of ``tensor``."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data))


def with_checksums(payload: dict) -> dict:
    """``payload`` plus ``{path: crc32}`` of each of its tensors (what :func:`load_file` verifies)."""
    return dict(payload, **{CHECKSUMS_KEY: {path: tensor_crc(t) for path, t in _tensors(payload)}})


def verify_checksums(obj: dict, path: str, what: str = "checkpoint file") -> None:
    """CheckpointError naming the first tensor whose bytes differ from when it was saved."""
    saved = obj.get(CHECKSUMS_KEY)
    if saved is None:  # written before checksums existed
        return
    for name, tensor in _tensors(obj):
        if saved.get(name) != tensor_crc(tensor):
            raise CheckpointError(f"{what} {path}: tensor {name} fails its checksum (the file is damaged); "
                                  "point --load at another checkpoint")


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
    """{(tp_rank, pp_rank[, ep_rank[, etp_rank]]): file} of a save folder (its latest iteration) or an ``iter_*`` folder."""
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


MODEL_KEYS = ("iteration", "consumed_samples", "config", "tp_size", "pp_size", "model")
RNG_KEYS = ("python", "numpy", "torch_cpu", "tracker")


def read_model_file(path: str) -> dict:
    """The whole payload of one ``model_optim_rng.pt`` (CPU tensors); CheckpointError if missing,
    corrupt, or not a model file (its ``model`` must be a list of state dicts, one per chunk)."""
    ckpt = load_file(path, keys=MODEL_KEYS)
    chunks = ckpt["model"]
    if not isinstance(chunks, list) or not chunks or not all(isinstance(c, dict) for c in chunks):
        raise CheckpointError(f"checkpoint file {path} is not a megatron_lite checkpoint file (its 'model' is "
                              f"a {type(chunks).__name__}, not a list of state dicts); point --load at another checkpoint")
    return ckpt


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
    ckpt = read_model_file(file)
    out = dict(ckpt["config"])
    for key in ("iteration", "tp_size", "pp_size", "vpp_size"):
        out.setdefault(key, ckpt.get(key))
    return out


def on_every_rank(step):
    """Run ``step()`` (local work, no collectives inside) on every rank; if it raises CheckpointError on
    any rank, raise the same error (the lowest failing rank's message) on every rank.

    So a checkpoint one rank refuses stops every rank cleanly with one message, instead of the other
    ranks dying in their next collective. Where that agreement itself fails (a peer rank stopped), a
    rank with an error of its own raises it, unagreed (marked rank-local, so that every such rank prints
    and exits at once, also outside the training loop and when rank 0 is the one gone): its message,
    not the collective's traceback.
    """
    error, result = None, None
    try:
        result = step()
    except CheckpointError as err:
        error = str(err)
    if dist.is_available() and dist.is_initialized():
        errors = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(errors, error)
        except Exception:  # a peer rank gone: this rank's own error, if it has one, is its message
            if error is None:
                raise
            unagreed = CheckpointError(error)
            unagreed.rank_local = True  # this rank's alone: it exits at once, printing it (errors.py)
            raise unagreed from None
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise raised_on_every_rank(CheckpointError(error))
    return result
