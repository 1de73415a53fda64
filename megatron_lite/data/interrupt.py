"""SIGTERM as Ctrl-C for the data tools, so that a killed run cleans up like an interrupted one.

``kill PID``, a job scheduler's time limit or ``timeout`` send SIGTERM, whose default action ends the
process at once: the ``finally`` blocks that remove the temporary ``.bin/.idx`` files never run, and
forked pool workers are left writing to a closed pipe.  Inside ``terminate_as_interrupt()`` a SIGTERM
to the main thread raises ``Terminated`` (a ``KeyboardInterrupt``) instead, so the same cleanup runs;
the tool then exits with ``128 + SIGTERM`` (143), as a shell reports a process killed by it.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGTERM_EXIT_CODE = 128 + int(signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM inside ``terminate_as_interrupt()``."""


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM raises ``Terminated`` in the main thread while inside; the previous handler comes back after.
    Outside the main thread (where handlers cannot be set) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted_exit_code(err: KeyboardInterrupt) -> int:
    """143 for SIGTERM, 130 for Ctrl-C (as a shell reports them)."""
    return SIGTERM_EXIT_CODE if isinstance(err, Terminated) else 128 + int(signal.SIGINT)


def default_sigterm_in_worker() -> None:
    """For a forked pool worker: SIGTERM (how ``Pool.terminate`` stops it) ends it quietly, as by default."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def workers_ignore_ctrl_c():
    """Worker processes started inside ignore SIGINT from their first instruction, the main process
    handling Ctrl-C (cleanup, one line) alone: a terminal sends SIGINT to every process of the group,
    and a spawned worker still importing (or waiting for work) printed a KeyboardInterrupt traceback.
    An ignored signal stays ignored across exec, and Python then installs no KeyboardInterrupt handler.
    Outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
