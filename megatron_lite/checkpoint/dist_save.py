"""Writing a torch_dist checkpoint, synchronously or in the background (``--async-save``).

Every save goes to a temporary folder ``<save>/.tmp_iter_XXXXXXX``: each rank writes its RNG file,
rank 0 ``common.pt``, and every rank its pieces through ``torch.distributed.checkpoint`` (whose
``.metadata`` is written once all ranks' data is on disk). Then rank 0 *finalizes*: renames the
folder to ``iter_XXXXXXX`` (an existing one is first renamed aside, see :func:`finalize_save`) and
writes the tracker file. Until then nothing points at the new checkpoint, so a crash at any moment
leaves the previous one the latest.

With ``--async-save`` the pieces are copied to CPU memory at save time (this rank's shards only,
never the whole model) and written by a background thread, over a gloo group of its own, while
training goes on; the thread also finalizes it (rank 0). :class:`AsyncSaves` polls the thread every
iteration and reports the save when it is done, and waits for it before the next save and at the end
of the run.

A write failing on some ranks only (a full disk, no permission, any exception) never leaves the
others waiting in a collective: the ranks agree on the failure before DCP's collective save and again
before the finalize (:func:`agree`), then rank 0 removes the temporary folder. A synchronous save
then raises the same CheckpointError on every rank; an async one is one warning (the logging rank),
and the failure of the run's last save stops the run at :meth:`AsyncSaves.wait`.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import warnings

import torch.distributed as dist

from ..console import is_logging_rank
from ..device import process_group_timeout
from ..files import remove_stale_temps
from .dist import common_payload, rank_pieces
from .dist_read import DIST_CHECKSUMS_DIR, DIST_COMMON_FILENAME, PIECE_CHECKSUMS_MARK
from .format import (
    ASIDE_PREFIX,
    CHECKSUMS_KEY,
    PROGRESS_FILENAME,
    TEMP_PREFIX,
    TRACKER_FILENAME,
    CheckpointError,
    aside_dir,
    atomic_save,
    atomic_write_text,
    iteration_dir,
    on_every_rank,
    restore_aside,
    temp_dir,
    tensor_crc,
    with_checksums,
)
from .save_lost import PeerLost, SaveProgress, lost_during_save, lost_peer, lost_peer_as_error


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def agree(error: str | None, group=None) -> str | None:
    """The lowest failing rank's ``error`` over ``group``, the same on every rank (collective), or None."""
    if not _distributed():
        return error
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e is not None), None)


def _inner(err: BaseException, rank: int) -> tuple[int, BaseException]:
    """(the failing rank, its exception): for DCP's CheckpointException, which every rank raises, the
    first rank that failed inside it and its own exception; else (``rank``, ``err``)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        err = inner if isinstance(inner, BaseException) else err
    return rank, err


def _cause(err: BaseException, rank: int) -> tuple[int, str]:
    """(the failing rank, one line: the exception's type and last line), as :func:`_inner` finds it."""
    rank, err = _inner(err, rank)
    text = str(err).strip().splitlines()
    return rank, f"{type(err).__name__}{': ' + text[-1][:200] if text else ''}"


def write_failed(folder: str, err: BaseException, rank: int) -> str:
    """The one-line reason a rank's write of ``folder`` failed (a collective failing because a peer
    rank was lost is no write error of this rank's: :class:`~.save_lost.PeerLost`)."""
    rank, cause = _cause(err, rank)
    return f"rank {rank} could not write torch_dist checkpoint {folder}: {cause}; the previous checkpoint stays the latest"


def agreement_lost(err: BaseException, rank: int) -> PeerLost:
    """The ranks' agreement (or DCP's collectives) failed: a peer rank stopped, the collectives timed out,
    or they failed otherwise. Worded by :func:`~.save_lost.lost_during_save`, as any lost peer of a save."""
    return PeerLost(lost_peer(_inner(err, rank)[1]) or f"the ranks' collectives failed ({_cause(err, rank)[1]})")


def write_pieces(pieces: dict, folder: str, group=None) -> None:
    """``torch.distributed.checkpoint.save`` of this rank's pieces (collective over ``group``), and
    their CRC-32s in ``checksums/rank_XXXXX.pt`` (verified by every read, see dist_read.load_keys).

    A rank that cannot write its checksums file (a full disk, no permission) must not leave the others
    waiting in DCP's collectives: the ranks agree on it first, and all raise the same CheckpointError.
    An agreement that fails, or DCP's collectives failing because a peer rank was lost, raises
    :class:`~.save_lost.PeerLost` (a rank with an error of its own raises that instead)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    rank = dist.get_rank() if _distributed() else 0
    error = None
    try:
        # the checksums first: DCP's save is collective, so every rank's file is complete before any
        # rank returns from it (rank 0 may then rename the folder: --async-save)
        crcs = {key: tensor_crc(t) for key, t in pieces.items()}
        atomic_save({CHECKSUMS_KEY: crcs}, os.path.join(folder, DIST_CHECKSUMS_DIR, f"rank_{rank:05d}.pt"))
    except Exception as err:
        error = write_failed(folder, err, rank)
    try:
        error = agree(error, group)
    except Exception as err:  # a peer rank gone (its connection closed) or the collective timed out
        raise (CheckpointError(error) if error else agreement_lost(err, rank)) from None
    if error is not None:
        raise CheckpointError(error)
    try:
        with warnings.catch_warnings():  # a single process without torch.distributed is no surprise here
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(pieces, storage_writer=dcp.FileSystemWriter(folder), process_group=group, no_dist=not _distributed())
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        if lost_peer(_inner(err, rank)[1]):  # its collectives failed with a peer rank gone: no write error
            raise agreement_lost(err, rank) from None
        raise CheckpointError(write_failed(folder, err, rank)) from None


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def tidy_asides(root: str) -> None:
    """Every ``.old_iter_N`` (``.old_release``) an earlier save left under ``root``: renamed back to
    ``iter_N`` where that is missing (the save died between its renames: this is the old checkpoint,
    whole), removed where ``iter_N`` exists (it died after them, or while removing it: stale, maybe
    half gone), whatever iteration the tracker names now."""
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not _leftover_name(name, ASIDE_PREFIX):
            continue
        kept = name[len(ASIDE_PREFIX):]
        iteration = "release" if kept == "release" else int(kept[len("iter_"):])
        restore_aside(root, iteration)
        if os.path.lexists(iteration_dir(root, iteration)):
            _remove(os.path.join(root, name))


def _leftover_name(name: str, prefix: str) -> bool:
    """``name`` is ``<prefix>iter_XXXXXXX`` or ``<prefix>release``."""
    kept = name[len(prefix):]
    return name.startswith(prefix) and (kept == "release" or re.fullmatch(r"iter_\d{7,}", kept) is not None)


def sweep_temps(root: str, iteration, keep: str | None = None) -> None:
    """Rank 0, at the start of a save, every rank past any earlier one: remove every ``.tmp_iter_N``
    (``.tmp_release``) under ``root``, what saves killed mid-write (SIGKILL, power loss) left, a
    checkpoint's worth of disk each, whatever their iteration. This save's own (``iteration``) must go:
    an OSError there fails the save; the others are removed best effort. ``keep``: the temporary folder
    of an ``--async-save`` still in flight, never touched. It also removes the tracker's (and
    progress.txt's) temporary files of writers killed between their write and rename, never one a
    live process may still be writing (files.remove_stale_temps: the process id is in the name)."""
    remove_stale_temps(root, (TRACKER_FILENAME, PROGRESS_FILENAME))
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if not _leftover_name(name, TEMP_PREFIX) or (keep is not None and os.path.abspath(path) == os.path.abspath(keep)):
            continue
        if path == temp_dir(root, iteration):
            _remove(path)
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


def finalize_save(root: str, iteration) -> None:
    """Rank 0, once every rank's files are complete: the folder takes its name, the tracker names it.

    An existing ``iter_N`` (which the tracker may name: a save repeating the latest iteration) is
    renamed aside to ``.old_iter_N`` before the new folder takes its name, and deleted once the
    tracker is written: a crash between the renames leaves the old folder, which
    :func:`~.format.read_tracker` (or this function, at the next save) renames back; a crash after
    them leaves a stale ``.old_iter_N`` that loading ignores and the next save removes
    (:func:`tidy_asides`)."""
    final, aside = iteration_dir(root, iteration), aside_dir(root, iteration)
    tidy_asides(root)  # what earlier saves that died between or after their renames left
    if os.path.lexists(final):
        os.rename(final, aside)
    os.rename(temp_dir(root, iteration), final)
    atomic_write_text(os.path.join(root, TRACKER_FILENAME), f"{iteration}\n")
    _remove(aside)  # the new checkpoint is committed


def write_small_files(root, iteration, common, rng, rank, rng_name) -> None:
    """This rank's RNG file (and rank 0's ``common.pt``) in the temporary folder."""
    tmp = temp_dir(root, iteration)
    if rng is not None:  # None: --no-save-rng
        atomic_save(with_checksums(rng), os.path.join(tmp, "rng", rng_name))
    if rank == 0:
        # the marker tells a checkpoint whose checksums/ folder was lost from one saved before it existed
        atomic_save(with_checksums(dict(common, **{PIECE_CHECKSUMS_MARK: True})), os.path.join(tmp, DIST_COMMON_FILENAME))


def discard_temp(root: str, iteration) -> None:
    """Rank 0, once every rank is past a failed save: remove its temporary folder (best effort)."""
    shutil.rmtree(temp_dir(root, iteration), ignore_errors=True)


def discard_failed_save(err: BaseException, root: str, iteration, rank: int) -> None:
    """After a failed save (either format): rank 0 removes its temporary folder when every rank agreed
    on the failure (every rank is then done with the folder); otherwise the next save sweeps it."""
    if rank == 0 and getattr(err, "on_every_rank", False):
        discard_temp(root, iteration)


class _Pending:
    """One background write: its thread and, when it failed, why (the same on every rank)."""

    def __init__(self, root, iteration, pieces, group, say):
        self.root, self.iteration, self.say = root, iteration, say
        self.error = "the writer thread stopped before it finished"  # until it says otherwise
        self.progress = SaveProgress()  # how far it got, for the line of a peer lost meanwhile
        self.thread = threading.Thread(target=self._run, args=(pieces, group), daemon=True,
                                       name=f"async-save-{iteration}")
        self.thread.start()

    def _run(self, pieces, group) -> None:
        """Write, agree over ``group`` whether every rank did, finalize (rank 0), agree again. Every
        exception is caught and every rank reaches each agreement, so no rank's thread waits for a
        failed one. A peer that died fails the group's collectives at once (gloo: its connections close),
        one that hangs after --distributed-timeout-minutes; rank 0 then removes the temporary folder."""
        rank = dist.get_rank() if _distributed() else 0
        tmp, error, lost = temp_dir(self.root, self.iteration), None, None
        try:
            write_pieces(pieces, tmp, group)
        except CheckpointError as err:
            error = str(err)
        except PeerLost as err:  # the write's agreement or DCP's collectives: the ranks cannot agree any more
            lost = err
        except BaseException as err:  # whatever stops the write, it fails on every rank
            error = write_failed(tmp, err, rank)
        try:
            if lost is not None:
                raise lost
            error = agree(error, group)
            self.progress.renaming = error is None
            if rank == 0:
                error = self._finalize_or_discard(error)
            self.error = agree(error, group)
        except BaseException as err:  # a peer gone (its connection closed) or the collectives timed out
            if rank == 0 and not self.progress.renamed:  # not finalized: remove the folder
                discard_temp(self.root, self.iteration)
            self.error = error or lost_during_save(agreement_lost(err, rank).what, self.root, self.iteration,
                                                   self.progress, rank)

    def _finalize_or_discard(self, error: str | None) -> str | None:
        """Rank 0, every rank's write done: rename the folder into place, or remove it after a failure."""
        if error is None:
            try:
                finalize_save(self.root, self.iteration)
                self.progress.renamed = True
                return None
            except OSError as err:
                error = (f"could not rename {temp_dir(self.root, self.iteration)} into place: {err.strerror or err} "
                         f"({err.filename}); the previous checkpoint stays the latest")
            except BaseException as err:  # the other ranks wait for this one's word in the next agreement
                error = str(err) if isinstance(err, CheckpointError) else write_failed(
                    temp_dir(self.root, self.iteration), err, 0)
        discard_temp(self.root, self.iteration)
        return error


class AsyncSaves:
    """The ``--async-save`` writes of one run (at most one in flight); owned by the training loop."""

    def __init__(self, on_saved=None):
        self.pending: _Pending | None = None
        self.group = None  # a gloo group for the writer threads' collectives, made at the first save
        self.on_saved = on_saved  # on_saved(root, iteration): after a write landed (retention.after_save)

    def start(self, root, iteration, pieces, say) -> None:
        """Write ``pieces`` (CPU copies) in the background; it is reported in :meth:`poll` / :meth:`wait`."""
        self.wait()
        if _distributed() and self.group is None:  # collective: every rank saves together
            self.group = dist.new_group(backend="gloo", timeout=process_group_timeout())
        self.pending = _Pending(root, iteration, {k: v.to("cpu", copy=True) for k, v in pieces.items()},
                                self.group, say)

    def in_flight(self) -> str | None:
        """The temporary folder of the write in flight, or None."""
        return None if self.pending is None else temp_dir(self.pending.root, self.pending.iteration)

    def poll(self) -> None:
        """Report the write in flight if it has completed (every iteration; no collectives)."""
        if self.pending is not None and not self.pending.thread.is_alive():
            self._finish()

    def wait(self, final: bool = False) -> None:
        """Block until the write in flight is complete (bounded: see :meth:`_Pending._run`), and report
        it. ``final`` (the end of the run, collective): a failed write is a CheckpointError on every rank,
        as a failed save is without ``--async-save``; before that a failure is a warning, and the next
        save may succeed."""
        error, pending = None, self.pending
        if pending is not None:
            error = self._finish(final)
        if final:  # a peer lost meanwhile (its writer failed with it): one line, not gloo's traceback
            with lost_peer_as_error(lambda err: _lost_at_the_end(err, pending)):
                on_every_rank(lambda: _raise(error))

    def _finish(self, final: bool = False) -> str | None:
        """The write just done (finalized or discarded by its thread): returns why it failed (and,
        unless ``final``, warns once: the logging rank), or None."""
        pending, self.pending = self.pending, None
        pending.thread.join()
        if pending.error is not None:
            error = f"async save of iteration {pending.iteration} to --save {pending.root} failed: {pending.error}"
            if not final:
                pending.say(f"WARNING: {error}", flush=True)
            return error
        pending.say(f"  successfully saved checkpoint at iteration {pending.iteration:7d} to {pending.root} "
                    "(async)", flush=True)
        if self.on_saved is not None:  # no write in flight now: older checkpoints may go
            self.on_saved(pending.root, pending.iteration)
        return None


def _lost_at_the_end(err: BaseException, pending: _Pending | None) -> str | None:
    """The line for a peer rank lost while the ranks agree on the run's last async save (:meth:`AsyncSaves.wait`)."""
    what = lost_peer(err)
    if what is None or pending is None:
        return None if what is None else f"{what} at the end of the run"
    return (f"{what} at the end of the run, while the ranks agreed on the --async-save of iteration "
            f"{pending.iteration}; {os.path.join(pending.root, TRACKER_FILENAME)} names the latest complete checkpoint")


def _raise(error: str | None) -> None:
    if error is not None:
        raise CheckpointError(error)


def save_dist(iteration, chunks, optimizer, scheduler, consumed, config, state, rng, saves, steps,
              progress: SaveProgress | None = None, consumed_valid: int | None = None) -> str:
    """Write checkpoint ``iteration`` in the torch_dist format (collective). ``rng``: this rank's
    RNG states; ``saves``: an :class:`AsyncSaves` for ``--async-save``, else None; ``steps(fn)``
    runs a local step on every rank and raises its CheckpointError everywhere; ``progress`` records
    the final step (:mod:`.save_lost`)."""
    root = config.checkpoint.save
    rank = dist.get_rank() if _distributed() else 0
    say = print if is_logging_rank(state) else (lambda message, **kwargs: None)
    if saves is not None:
        saves.wait()  # one save in flight at a time: its tracker comes before this one's
    tmp = temp_dir(root, iteration)

    def clear():  # folders left by saves that died (every rank is past the earlier saves of this run)
        if rank == 0:
            sweep_temps(root, iteration, keep=saves.in_flight() if saves is not None else None)
    steps(clear)
    try:
        common = common_payload(iteration, consumed, chunks, optimizer, scheduler, config, state, consumed_valid)
        steps(lambda: write_small_files(root, iteration, common, rng, rank, f"rank_{rank:05d}.pt"))
        pieces = rank_pieces(chunks, optimizer, state)
        if saves is not None:
            saves.start(root, iteration, pieces, say)
            return iteration_dir(root, iteration)
        steps(lambda: write_pieces(pieces, tmp))
        final = (progress or SaveProgress()).final_step((lambda: finalize_save(root, iteration)) if rank == 0 else None)
        steps(final)
    except CheckpointError as err:
        discard_failed_save(err, root, iteration, rank)
        raise
    say(f"  successfully saved checkpoint at iteration {iteration:7d} to {root}", flush=True)
    return iteration_dir(root, iteration)
