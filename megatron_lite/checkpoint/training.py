"""Save and resume training: model, optimizer, scheduler, loss scaler, RNG states, consumed samples.

This module writes and reads the ``torch`` format (``--ckpt-format torch_dist`` is delegated to
:mod:`~megatron_lite.checkpoint.dist_save` and :mod:`~megatron_lite.checkpoint.dist`).
The folder layout is in :mod:`megatron_lite.checkpoint.format`. With ``--use-distributed-optimizer``
the optimizer's ``state_dict`` is collective (it gathers the shards over data parallelism into the
plain optimizer's format), so every rank calls it and the model file stores it like the plain
optimizer's: one copy, loadable at any data-parallel size and by either optimizer.

Why it is safe to crash at any moment: every file is written atomically, and the tracker file that
says which iteration is "latest" is renamed into place by rank 0 only after a barrier that every
rank reaches once its files are complete. Every rank writes into ``.tmp_iter_*``, which rank 0
renames to ``iter_*`` (replacing what an earlier save left there) before the tracker names it. A save
that dies half-way leaves only the temporary folder (a write that fails, which every rank hears of,
removes it); the previous checkpoint stays the latest.

The model file is written by data-parallel rank 0 of each (TP, PP) position: weights and the
(non-distributed) optimizer state are identical across data-parallel ranks. RNG states are saved
by every rank, because dropout streams differ per rank.
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from ..console import is_logging_rank, print_rank_0
from ..optim.optimizer import saved_optimizer_name
from ..parallel.fsdp import full_params
from .arch import check_architecture
from .compat import check_compatible, check_sizes, layer_range
from .dist import is_fresh_layout, layout_of, load_dist
from .dist_read import checkpoint_format, read_common
from .dist_save import discard_failed_save, finalize_save, save_dist, sweep_temps, temp_dir
from .expert_files import expert_grid_fields, model_file_for, writes_model_file
from .format import (
    FORMAT_VERSION,
    RNG_KEYS,
    CheckpointError,
    atomic_save,
    check_optimizer_name,
    find_model_files,
    iteration_dir,
    load_file,
    on_every_rank,
    param_meta,
    read_model_file,
    restore_scheduler,
    rng_file,
    saved_config,
    with_checksums,
)
from .frozen import (
    base_of,
    base_reference,
    fit_fp8_state,
    load_saved_state,
    require_base,
    saved_state_dict,
    set_base,
    unwrap,
)
from .load_source import load_source, no_tracker
from .pretrained import check_base, check_lora_resume, load_model_weights_here, trainable_may_be_missing
from .resume_notes import describe_layout, print_resume_notes, torch_file_layout, transformer_engine_note
from .rng import set_rng_states
from .router_bias import fill_state_dict, refuse_optimizer, say_filled
from .save_lost import SaveProgress, peer_lost_as_error, peer_lost_loading
from .saved_parts import missing_rng_error, parts_to_save, require_dist_rng, save_rng
from .upcycle import upcycle_here, upcycles


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---------------------------------------------------------------------------------------------
# Save.


def _writing(write, root, iteration):
    """``write`` with an OSError (disk full, no permission, a folder in the way) as one CheckpointError."""
    def step():
        try:
            write()
        except OSError as err:
            raise CheckpointError(
                f"could not save checkpoint iteration {iteration} to --save {root}: {err.strerror or err} "
                f"({err.filename}); the previous checkpoint stays the latest"
            ) from None
    return step


def save_checkpoint(iteration, chunks, optimizer, scheduler, consumed_samples, config, state, async_saves=None,
                    consumed_valid_samples=None, root: str | None = None) -> str:
    """Write checkpoint ``iteration`` under ``config.checkpoint.save``; collective over all ranks.

    ``chunks`` are the model chunks (DistributedDataParallel wrappers are unwrapped). ``optimizer``
    and ``scheduler`` may be None. ``--ckpt-format torch_dist`` writes the sharded format
    (:mod:`~megatron_lite.checkpoint.dist_save`); ``async_saves`` (an AsyncSaves, with
    ``--async-save``) writes it in the background. ``consumed_valid_samples``: the validation samples
    the run has read, recorded so that a resume with other --eval-interval / --eval-iters continues
    validation there. ``root``: another folder than --save to write to (the non-persistent checkpoints').
    Returns the iteration folder; deleting older ones is the caller's (:mod:`.retention`).
    """
    if root is not None and root != config.checkpoint.save:
        config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, save=root))
    root = config.checkpoint.save
    if root is None:
        raise CheckpointError("save_checkpoint needs --save (a folder to write checkpoints to)")
    # printed by the rank that prints the iteration lines, so it comes after this iteration's line
    say = print if is_logging_rank(state) else (lambda message, **kwargs: None)
    say(f"saving checkpoint at iteration {iteration:7d} to {root}" + (" (async)" if async_saves else ""), flush=True)
    optimizer, scheduler, rng = parts_to_save(optimizer, scheduler, config, state)  # --no-save-optim/-rng
    progress = SaveProgress()
    # a peer rank lost in any of the save's collectives: one line (what is on disk), not gloo's traceback
    with peer_lost_as_error(root, iteration, progress):
        if config.checkpoint.ckpt_format == "torch_dist":
            with full_params(chunks):  # ZeRO-3 / --overlap-param-gather: full weights to cut pieces from
                folder = save_dist(iteration, chunks, optimizer, scheduler, consumed_samples, config, state, rng,
                                   async_saves, lambda step: on_every_rank(_writing(step, root, iteration)), progress,
                                   consumed_valid_samples)
        else:
            folder = _save_torch(iteration, chunks, optimizer, scheduler, (consumed_samples, consumed_valid_samples),
                                 config, state, rng, progress)
            say(f"  successfully saved checkpoint at iteration {iteration:7d} to {root}", flush=True)
    return folder


def _save_torch(iteration, chunks, optimizer, scheduler, consumed, config, state, rng, progress) -> str:
    """:func:`save_checkpoint` in the ``torch`` format (collective); ``consumed``: (train, validation) samples."""
    root, rank = config.checkpoint.save, _global_rank()
    consumed_samples, consumed_valid_samples = consumed
    base = base_of(chunks)  # frozen (LoRA base) weights are not saved: where they come from is
    # every rank: the distributed optimizer's state_dict is a collective (a gather over data parallel)
    optim_state = None if optimizer is None else optimizer.state_dict()
    # written into .tmp_iter_XXXXXXX, renamed once complete: files an earlier save left in iter_XXXXXXX
    # (another layout's, a torch_dist checkpoint's) never mix with this one's
    tmp, final = temp_dir(root, iteration), iteration_dir(root, iteration)

    def staged(path):
        return os.path.join(tmp, os.path.relpath(path, final))

    def clear():  # folders left by saves that died (every rank is past the earlier saves of this run)
        if rank == 0:
            sweep_temps(root, iteration)

    def write_files():
        save_rng(rng, staged(rng_file(root, iteration, rank)))
        if writes_model_file(state):
            modules = [unwrap(c) for c in chunks]
            payload = {
                "iteration": int(iteration),
                "consumed_samples": int(consumed_samples),
                "consumed_valid_samples": consumed_valid_samples,
                "config": saved_config(config),
                "tp_size": state.tp_size,
                "pp_size": state.pp_size,
                "ep_size": state.ep_size,
                **expert_grid_fields(state),
                "dp_size": state.dp_size,
                "vpp_size": state.vpp_size,
                "num_chunks": len(modules),
                "world_size": state.world_size,
                "model": [saved_state_dict(m) for m in modules],
                "frozen_base": base,
                "param_meta": [param_meta(m) for m in modules],
                "layer_ranges": [layer_range(m) for m in modules],
                "optimizer": optim_state,
                "scheduler": None if scheduler is None else scheduler.state_dict(),
                "format_version": FORMAT_VERSION,
            }
            atomic_save(with_checksums(payload), staged(model_file_for(root, iteration, state)))

    # every rank's files are complete before anything points at them; a failed write (disk full,
    # permissions) stops every rank with one line and leaves the previous checkpoint the latest
    on_every_rank(_writing(clear, root, iteration))
    try:
        with full_params(chunks):  # ZeRO-3: the full weights, gathered on every rank (a collective)
            on_every_rank(_writing(write_files, root, iteration))
        # rank 0: the folder takes its name, then the tracker names it
        update_tracker = progress.final_step((lambda: finalize_save(root, iteration)) if rank == 0 else None)
        on_every_rank(_writing(update_tracker, root, iteration))
    except CheckpointError as err:
        discard_failed_save(err, root, iteration, rank)
        raise
    return iteration_dir(root, iteration)


# ---------------------------------------------------------------------------------------------
# Load.


def _explain_missing(path: str, folder: str, state) -> None:
    """This rank's file is absent: if the folder holds files of another TP/PP layout, say so."""
    try:
        others = find_model_files(folder)
    except CheckpointError:
        return  # nothing there at all: load_file reports the missing file
    other = others[min(others)]
    check_sizes(other, read_model_file(other), state)


class Resumed(tuple):
    """``(iteration, consumed_samples)`` of a resumed checkpoint, as :func:`load_checkpoint` returns them;
    ``consumed_valid_samples``: the validation samples its run had read (None: not recorded, a
    checkpoint saved before it was, or by the converter)."""

    def __new__(cls, iteration: int, consumed_samples: int, consumed_valid_samples=None, source=None):
        out = super().__new__(cls, (iteration, consumed_samples))
        out.consumed_valid_samples = None if consumed_valid_samples is None else int(consumed_valid_samples)
        out.source = source  # the folder it came from: --load, or the non-persistent one
        return out


def _restore_rng(root, iteration, ckpt, state) -> None:
    rank = _global_rank()
    rng_path = rng_file(root, iteration, rank)
    if not os.path.isfile(rng_path):
        raise missing_rng_error(root, iteration, rank, ckpt.get("world_size"), state.world_size)
    try:
        set_rng_states(load_file(rng_path, "RNG state file", keys=RNG_KEYS), state.rng_tracker)
    except (TypeError, ValueError, KeyError, RuntimeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"RNG state file {rng_path} holds states of the wrong kind ({type(err).__name__}); "
                              "pass --no-load-rng or point --load at another checkpoint") from None


def _load_here(chunks, optimizer, scheduler, config, state) -> tuple[int, int]:
    """This rank's part of :func:`load_checkpoint`: reads, checks and restores, no collectives."""
    ck = config.checkpoint
    root, iteration = load_source(ck) if ck.load else (None, None)  # --ckpt-step; a newer non-persistent one
    if upcycles(config, root, iteration):  # --moe-use-upcycling, a dense checkpoint: experts made of its MLPs
        upcycle_here(chunks, optimizer, root, config, state)
        return 0, 0
    if iteration is None:
        if ck.pretrained_checkpoint:  # --load has nothing yet: start from the pretrained weights
            if root:
                no_tracker(root, quiet=True)
            print_rank_0(f"loading pretrained weights from {ck.pretrained_checkpoint}")
            _load_base(chunks, optimizer, ck.pretrained_checkpoint, config, state)
        else:
            no_tracker(root, finetune=ck.finetune, exit_on_missing=ck.exit_on_missing_checkpoint)
        return 0, 0
    print_rank_0(f"loading checkpoint from {root} at iteration {iteration}")
    if ck.finetune or iteration == "release":  # weights only, from any format and layout
        source = root if ck.ckpt_step is None else iteration_dir(root, iteration)  # not the tracker's iteration
        _load_base(chunks, optimizer, source, config, state, flag="--load", every_flag=not ck.finetune)
        return 0, 0
    if checkpoint_format(root, iteration, ck) == "torch_dist":
        folder = iteration_dir(root, iteration)  # a frozen (LoRA) base first, outside full_params
        _load_frozen_base(folder, read_common(folder), chunks, config, state)
        with full_params(chunks, load=True):  # ZeRO-3: full-size storage to load into, then re-sharded
            loaded = _load_dist_here(root, iteration, chunks, optimizer, scheduler, config, state)
        if ck.no_load_optim:  # after the re-shard: ZeRO-3's masters are read from the param shards
            _refresh_masters(optimizer)
        return loaded
    path = model_file_for(root, iteration, state)
    if not os.path.isfile(path):
        _explain_missing(path, iteration_dir(root, iteration), state)
    ckpt = read_model_file(path)
    modules = [unwrap(c) for c in chunks]
    ckpt["model"] = [fit_fp8_state(m, saved) for m, saved in zip(modules, ckpt["model"])]
    filled = [k for m, saved in zip(modules, ckpt["model"]) for k in fill_state_dict(saved, saved_state_dict(m))]
    say_filled(path, filled)
    _load_frozen_base(path, ckpt, chunks, config, state)
    with full_params(chunks, load=True):  # ZeRO-3: full-size storage to load into, then re-sharded
        check_compatible(path, ckpt, modules, config, state)
        check_architecture(path, ckpt.get("config", {}), config)
        for module, saved in zip(modules, ckpt["model"]):
            load_saved_state(module, saved)

    if not ck.no_load_optim:
        if optimizer is not None:
            optim_state = ckpt.get("optimizer")
            if optim_state is None:
                raise CheckpointError(f"checkpoint {path} has no optimizer state; pass --no-load-optim or --finetune")
            if filled:
                refuse_optimizer(path)
            saved_name = saved_optimizer_name(optim_state.get("optimizer", optim_state))
            check_optimizer_name(path, saved_name, config.optim.optimizer)
            optimizer.load_state_dict(optim_state)
        if scheduler is not None and ckpt.get("scheduler") is not None:
            restore_scheduler(scheduler, ckpt["scheduler"], path)
    else:
        _refresh_masters(optimizer)
    if not ck.no_load_rng:
        _restore_rng(root, iteration, ckpt, state)
    print_resume_notes(torch_file_layout(ckpt), ckpt.get("config", {}), config, state)
    print_rank_0(f"  successfully loaded checkpoint from {root} at iteration {iteration}")
    return Resumed(int(ckpt["iteration"]), int(ckpt["consumed_samples"]), ckpt.get("consumed_valid_samples"), root)


def _refresh_masters(optimizer) -> None:
    """--no-load-optim: the fp32 masters of 16-bit params from the loaded weights (or a step undoes the load)."""
    if optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()


def _load_base(chunks, optimizer, path, config, state, flag="--pretrained-checkpoint", every_flag=False) -> None:
    """Model weights only from ``path``; a model with frozen (LoRA) weights records it as their base.
    ``every_flag``: every architecture flag must match (a converted release checkpoint without --finetune)."""
    folder = load_model_weights_here(chunks, optimizer, path, config, state, flag,
                                     missing_ok=trainable_may_be_missing(chunks, state), every_flag=every_flag)
    set_base(chunks, base_reference(folder))


def _load_frozen_base(path, ckpt, chunks, config, state) -> None:
    """Resuming LoRA (frozen weights): ``ckpt``'s --lora-* flags checked, then its base's weights (:mod:`.frozen`)."""
    saved = ckpt.get("frozen_base")
    folder = check_base(path, saved, chunks, config.checkpoint.pretrained_checkpoint)
    if folder is not None:
        check_lora_resume(path, ckpt.get("config", {}), config.lora)
        print_rank_0(f"loading the frozen base weights from {folder}")
        load_model_weights_here(chunks, None, folder, config, state, missing_ok=trainable_may_be_missing(chunks, state))
        set_base(chunks, saved)


def _load_dist_here(root, iteration, chunks, optimizer, scheduler, config, state) -> tuple[int, int]:
    """:func:`_load_here` for a torch_dist checkpoint: it loads at any TP x PP x DP layout."""
    ck, folder = config.checkpoint, iteration_dir(root, iteration)
    common = read_common(folder)
    check_architecture(folder, common["config"], config)
    load_dist(folder, common, chunks, optimizer, scheduler, state, not ck.no_load_optim)  # re-pads the vocabulary
    if not ck.no_load_rng:
        if is_fresh_layout(common, state):
            saved, now = describe_layout(common["layout"]), describe_layout(layout_of(state))
            raise CheckpointError(f"checkpoint {folder} was saved at {saved}, this run is {now}: its RNG states are "
                                  f"per rank and do not carry over to another layout; pass --no-load-rng (or resume at {saved})")
        path = require_dist_rng(folder, os.path.join(folder, "rng", f"rank_{_global_rank():05d}.pt"))
        set_rng_states(load_file(path, "RNG state file", keys=RNG_KEYS), state.rng_tracker)
    print_resume_notes(common["layout"], common["config"], config, state)
    print_rank_0(f"  successfully loaded checkpoint from {root} at iteration {iteration}")
    return Resumed(int(common["iteration"]), int(common["consumed_samples"]), common.get("consumed_valid_samples"),
                   root)


def load_checkpoint(chunks, optimizer, scheduler, config, state) -> tuple[int, int]:
    """Restore the latest checkpoint under ``config.checkpoint.load``; returns (iteration, consumed_samples).

    Without ``--load``, or when it names an absent or empty folder, nothing is loaded and (0, 0) is
    returned - or, with ``--pretrained-checkpoint``, only its weights (:mod:`.pretrained`), from
    iteration 0. A folder holding ``iter_*`` checkpoints but no readable tracker file is refused.
    The pair of a resumed checkpoint is a :class:`Resumed`, which also carries the validation samples
    its run had read. ``--no-load-optim`` skips the optimizer (with its loss scaler) and scheduler;
    ``--no-load-rng`` the RNG states; ``--finetune`` loads only the weights and returns (0, 0). Raises
    :class:`CheckpointError` for a missing/corrupt file or a checkpoint that does not fit, on every
    rank alike when any rank finds a problem.
    """
    if config.checkpoint.load is None and config.checkpoint.pretrained_checkpoint is None:
        return 0, 0
    with peer_lost_loading(config.checkpoint.load or config.checkpoint.pretrained_checkpoint):  # one line
        loaded = on_every_rank(lambda: _load_here(chunks, optimizer, scheduler, config, state))
    require_base(chunks, config.checkpoint.load)  # frozen (LoRA) weights came from a base checkpoint
    note = transformer_engine_note(config.precision) if loaded[0] else None  # a resume, not weights only
    if note:
        print_rank_0(note)
    return loaded
