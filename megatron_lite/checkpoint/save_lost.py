"""A peer rank lost in the middle of a synchronous save (killed, its node gone): one line, not a traceback.

The ranks of a save agree after each of its steps (:func:`~.format.on_every_rank`) and run collectives
in between (the distributed optimizer's gather, ZeRO-3's full weights). When a peer rank stops, those
collectives fail on the others with gloo's RuntimeError ("Connection reset by peer"); a rank with no
error of its own had only that traceback to show. :func:`peer_lost_as_error` makes it one
CheckpointError naming the save and what is on disk. Nothing is renamed into place before every rank
has agreed that its files are complete, so until the final step (rename and tracker) the previous
checkpoint stays the latest; in that step rank 0 knows whether it renamed the folder, the others do not.

The error is this rank's alone (the ranks could not agree on it): the training loop ends the rank at
once (:func:`~megatron_lite.errors.exit_with_message`, rank-local). The temporary folder is left to the
next save's sweep: a surviving peer may still be writing into it. A peer lost while the ranks load a
checkpoint (:func:`peer_lost_loading`) is one line the same way.

:func:`lost_during_save` is the one wording of a peer lost during a save, in either format and with
``--async-save``: torch_dist's writes (:mod:`.dist_save`: the agreement before DCP's save, DCP's own
collectives) raise :class:`PeerLost` where they meet it, and it is worded where the save's iteration and
progress are known (here for a synchronous save, in the async writer's thread).
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

import torch.distributed as dist

from .format import TRACKER_FILENAME, CheckpointError, iteration_dir, temp_dir

# what gloo says on a rank whose peer stopped (killed, crashed): its connection closed
PEER_STOPPED = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)
_TIMED_OUT = re.compile(r"timed? ?out", re.IGNORECASE)


class SaveProgress:
    """How far one synchronous save got, for the message of a save whose peer was lost."""

    def __init__(self):
        self.renaming = False  # the final step (rename and tracker) has begun
        self.renamed = False  # this rank (rank 0) renamed the folder into place and wrote the tracker

    def final_step(self, finalize):
        """The save's final step: ``finalize()`` (rank 0's rename and tracker; None on the other ranks)."""
        self.renaming = True

        def step():
            if finalize is not None:
                finalize()
                self.renamed = True
        return step


class PeerLost(RuntimeError):
    """A save's collective failed because a peer rank was lost (``what``: :func:`lost_peer`'s words, or
    "the ranks' collectives failed (...)" for an agreement failing otherwise); worded by
    :func:`lost_during_save` where the save's iteration and progress are known."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def lost_peer(err: BaseException) -> str | None:
    """What ``err`` says happened, when it is a collective failing because a peer rank stopped ("a
    peer rank stopped (Connection reset by peer)") or the collectives timed out; else None."""
    if isinstance(err, PeerLost):
        return err.what
    text = str(err).strip()
    stopped = PEER_STOPPED.search(text)
    if stopped:
        return f"a peer rank stopped ({stopped.group(0)})"
    if isinstance(err, dist.DistError) or _TIMED_OUT.search(text):
        first = text.splitlines()[0][:200] if text else ""
        return f"the ranks' collectives failed ({type(err).__name__}{': ' + first if first else ''})"
    return None


def lost_peer_message(err: BaseException, root: str, iteration, progress: SaveProgress, rank: int) -> str | None:
    """The one line for ``err``, a collective failing during the save of ``iteration`` because a peer
    rank stopped (or the collectives timed out); None for any other exception (not a lost peer)."""
    what = lost_peer(err)
    return None if what is None else lost_during_save(what, root, iteration, progress, rank)


def lost_during_save(what: str, root: str, iteration, progress: SaveProgress, rank: int) -> str:
    """The one line for a save of ``iteration`` under ``root`` whose ranks lost a peer: ``what`` happened
    (:func:`lost_peer`), and what is on disk as far as this rank knows (``progress``: whether the final
    step began, and whether this rank, rank 0, renamed the folder into place)."""
    tmp = temp_dir(root, iteration)
    if progress.renamed:
        after = f"{iteration_dir(root, iteration)} was complete and renamed into place first: it is the latest checkpoint"
    elif progress.renaming and rank != 0:
        after = (f"{os.path.join(root, TRACKER_FILENAME)} names the latest complete checkpoint (this one only if "
                 "rank 0 renamed it into place first)")
    else:
        after = "nothing was renamed into place, the previous checkpoint stays the latest" + (
            f" (the next save removes {tmp})" if os.path.isdir(tmp) else "")
    return f"{what} during the save of checkpoint iteration {iteration} into {tmp}; {after}"


@contextmanager
def lost_peer_as_error(message):
    """Inside, a collective failing because a peer rank stopped (or timing out) is a CheckpointError of
    this rank's, ``message(err)`` (marked rank-local: not agreed; the loop and the scripts end the rank
    at once); other exceptions, and a None message, pass unchanged."""
    try:
        yield
    except RuntimeError as err:  # gloo's failed collective (a CheckpointError is no RuntimeError)
        text = message(err)
        if text is None:
            raise
        error = CheckpointError(text)
        error.rank_local = True
        raise error from None


def peer_lost_as_error(root: str, iteration, progress: SaveProgress):
    """:func:`lost_peer_as_error` for a synchronous save (its message: :func:`lost_peer_message`)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return lost_peer_as_error(lambda err: lost_peer_message(err, root, iteration, progress, rank))


def peer_lost_loading(root: str | None):
    """:func:`lost_peer_as_error` for a load: nothing on disk changes, the run stops before training."""
    def message(err):
        what = lost_peer(err)
        return None if what is None else (f"{what} while loading checkpoint {root}; the run stops before "
                                          "training, nothing on disk was changed")
    return lost_peer_as_error(message)
