"""Which checkpoint ``--load`` resumes: the tracker's iteration, ``--ckpt-step``'s, or the newer
non-persistent one (``--non-persistent-ckpt-type global``).

- ``--ckpt-step N``: iteration N of ``--load``, whatever its tracker names (the tracker is not
  changed; the run's next save writes it). A missing iteration is one line naming the folder and the
  iterations it holds. Non-persistent checkpoints are not looked at: the step names a persistent one.
- ``--non-persistent-ckpt-type global``: the non-persistent folder (``--non-persistent-global-ckpt-dir``,
  default ``<load>/non_persistent``) is read too, and its checkpoint resumes when its iteration is at
  least the persistent one's (Megatron-LM's rule), else the persistent one.
"""

from __future__ import annotations

import os

from ..checkpoint_config import non_persistent_dir
from ..console import print_rank_0
from .format import (
    TRACKER_FILENAME,
    CheckpointError,
    is_iteration_folder,
    iteration_dir,
    iteration_folders,
    read_tracker,
    restore_aside,
)
from .hf_io import model_files_in


def _held(root: str) -> str:
    names = [n for n in iteration_folders(root) if n.startswith("iter_")]
    return ", ".join(str(int(n[len("iter_"):])) for n in names) or "none"


def step_folder(root: str, step: int) -> int:
    """``--ckpt-step``: ``step`` when ``root`` holds that checkpoint, else one CheckpointError."""
    restore_aside(root, step)  # a save repeating that iteration that died between its renames
    if not is_iteration_folder(iteration_dir(root, step)):
        raise CheckpointError(f"--ckpt-step {step}: --load {root} has no checkpoint {iteration_dir(root, step)} "
                              f"(iterations held: {_held(root)}); pick one of them or drop --ckpt-step")
    return step


def load_source(ck, quiet: bool = False) -> tuple[str, int | str | None]:
    """(folder, iteration) of the checkpoint this run resumes (iteration None: there is none);
    ``quiet``: without the line saying which of persistent / non-persistent it is."""
    say = (lambda line: None) if quiet else print_rank_0
    root = ck.load
    if ck.ckpt_step is not None:
        return root, step_folder(root, ck.ckpt_step)
    iteration = read_tracker(root)
    if ck.non_persistent_ckpt_type != "global":
        return root, iteration
    np_root = non_persistent_dir(ck, root)
    np_iteration = read_tracker(np_root) if os.path.isdir(np_root) else None
    if np_iteration is None or np_iteration == "release":
        return root, iteration
    if iteration is None or iteration == "release" or np_iteration >= iteration:
        say(f"> loading the non-persistent checkpoint of iteration {np_iteration} from {np_root} (the "
                     f"persistent one at --load: {'none' if iteration is None else iteration})")
        return np_root, np_iteration
    say(f"> the non-persistent checkpoint in {np_root} (iteration {np_iteration}) is older than the "
                 f"persistent one (iteration {iteration}): loading that")
    return root, iteration


def check_no_initialization(config) -> None:
    """--no-initialization leaves the weights as allocated: refused (one CheckpointError) unless a
    checkpoint will overwrite every one of them (--load holds one, or --pretrained-checkpoint)."""
    ck = config.checkpoint
    if not ck.no_initialization:
        return
    if config.moe.moe_use_upcycling:
        raise CheckpointError("--no-initialization with --moe-use-upcycling: the dense checkpoint has no router "
                              "weights to fill the uninitialised ones; drop --no-initialization")
    if ck.pretrained_checkpoint or (ck.load and load_source(ck, quiet=True)[1] is not None):
        return
    where = f"--load {ck.load} holds no checkpoint" if ck.load else "there is no --load"
    raise CheckpointError(f"--no-initialization skips drawing the initial weights, but {where} (nor "
                          "--pretrained-checkpoint) to load them from; drop --no-initialization")


def no_tracker(root: str, quiet: bool = False, finetune: bool = False, exit_on_missing: bool = False) -> None:
    """--load names a folder without a tracker: fine when it holds no checkpoints (a first run with
    --load and --save the same folder, unless ``finetune``: --finetune asks for weights, or
    ``exit_on_missing``: --exit-on-missing-checkpoint), refused when it does - never silently restart over them.
    A file, or one checkpoint's iteration folder, is refused too: neither is a save folder."""
    if os.path.isfile(root):
        raise CheckpointError(f"--load {root} is a file; point --load at the folder given to --save (the one "
                              f"holding {TRACKER_FILENAME})")
    if is_iteration_folder(root):
        raise CheckpointError(
            f"--load {root} is one checkpoint's iteration folder; point --load at the folder above it, "
            f"{os.path.dirname(os.path.normpath(root)) or '.'} (the save folder: its {TRACKER_FILENAME} names the "
            "iteration to load), or pass this folder to --pretrained-checkpoint to start from its weights"
        )
    hf_files = model_files_in(root)
    if "config.json" in hf_files and len(hf_files) > 1:  # config.json and its weights
        raise CheckpointError(f"--load {root} is a Hugging Face model folder; import it first: "
                              f"tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron --load-dir {root} "
                              "--save-dir OUT, then --load OUT (or --pretrained-checkpoint OUT)")
    folders = iteration_folders(root)
    if folders:
        raise CheckpointError(
            f"--load {root} holds {len(folders)} checkpoint folder(s) (newest {folders[-1]}) but no "
            f"{TRACKER_FILENAME}; write the iteration to load into it (or delete the folders), or point --load "
            "at an empty folder"
        )
    reason = "the folder does not exist" if not os.path.isdir(root) else "it holds no checkpoint"
    if finetune:
        raise CheckpointError(f"--finetune --load {root}: {reason}, so there are no weights to start from; point "
                              "--load at the checkpoint to fine-tune (the folder given to its --save)")
    if exit_on_missing:  # Megatron-LM exits (code 0) after a log line; a stop is an error here: exit code 2
        raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint at --load {root} ({reason}); point --load "
                              "at the folder given to --save of the run to resume, or drop the flag to train from scratch")
    if not quiet:
        print_rank_0(f"WARNING: no checkpoint found at --load {root} ({reason}); training from scratch")
