"""Writing a file whole: under a temporary name next to it, renamed over it once complete.

A write that fails (a full disk, an error in the data being written) or is interrupted removes the
temporary file and leaves the target as it was: nothing half-written is ever left on disk, under
either name. Only a process killed between its write and its rename (SIGKILL, power loss) leaves the
temporary file: :func:`remove_stale_temps` removes those whose writer is gone.
"""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def replaced_whole(path: str):
    """``with replaced_whole(path) as tmp:`` write ``tmp``; on leaving the block it replaces
    ``path``, or, if the block raised, it is removed and the exception goes on."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:  # never created, or already gone
            pass
        raise


def _writer_gone(pid: int) -> bool:
    """Whether the process that named a temporary file ``*.tmp.<pid>`` is no longer writing it: this
    process (which is not writing one while it sweeps) or no live process of that id here."""
    if pid == os.getpid() or pid <= 0:
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's: no permission to signal it)
        return False
    return False


def remove_stale_temps(folder: str, names: tuple[str, ...]) -> None:
    """Remove ``<name>.tmp.<pid>`` in ``folder`` (one of ``names``: what :func:`replaced_whole` writes
    first) when its writer is gone (:func:`_writer_gone`); never one a live process may still be
    writing (another run's or tool's, whose process id is in the name). Best effort."""
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        base, dot_tmp, pid = entry.rpartition(".tmp.")
        path = os.path.join(folder, entry)
        if dot_tmp and base in names and pid.isdigit() and _writer_gone(int(pid)) and os.path.isfile(path) \
                and not os.path.islink(path):
            try:
                os.remove(path)
            except OSError:
                pass
