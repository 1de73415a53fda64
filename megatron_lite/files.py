"""Writing a file (or a folder) whole: under a temporary name next to it, renamed over it once complete.

A write that fails (a full disk, an error in the data being written) or is interrupted removes the
temporary file and leaves the target as it was: nothing half-written is ever left on disk, under
either name. Only a process killed between its write and its rename (SIGKILL, power loss) leaves the
temporary file: :func:`remove_stale_temps` removes those whose writer is gone.
"""

from __future__ import annotations

import errno
import os
import shutil
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


@contextmanager
def replaced_folder(path: str, last: tuple[str, ...] = ()):
    """``with replaced_folder(path) as tmp:`` write a folder's files into ``tmp``; on leaving the block
    they become ``path``'s. ``path`` absent: ``tmp`` is ``<path>.tmp.<pid>`` beside it, renamed to
    ``path``; ``path`` an existing folder (perhaps a mount point, on another disk than its parent):
    ``tmp`` is ``<path>/.staged.tmp.<pid>`` and its entries are renamed into ``path``, the names in
    ``last`` after the others. If the block raised (a full disk, Ctrl-C), ``tmp`` is removed and the
    exception goes on: ``path`` is left as it was (not created). The temporary folder of an earlier
    writer that is gone (SIGKILL) is removed first."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_folders(parent, base)
    if os.path.isdir(path):
        _remove_stale_folders(path, STAGED)
        tmp = os.path.join(path, f"{STAGED}.tmp.{os.getpid()}")
    else:
        tmp = f"{path}.tmp.{os.getpid()}"
    os.mkdir(tmp)
    try:
        yield tmp
        _move_into(tmp, path, last)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


STAGED = ".staged"  # replaced_folder's temporary folder inside an existing target


def _remove_stale_folders(folder: str, stem: str) -> None:
    """Remove the ``<stem>.tmp.<pid>`` folders in ``folder`` whose writer is gone (best effort)."""
    for entry in os.listdir(folder):
        name, dot_tmp, pid = entry.rpartition(".tmp.")
        stale = os.path.join(folder, entry)
        if dot_tmp and name == stem and pid.isdigit() and _writer_gone(int(pid)) and os.path.isdir(stale) \
                and not os.path.islink(stale):
            shutil.rmtree(stale, ignore_errors=True)


def _move_into(src: str, dst: str, last: tuple[str, ...]) -> None:
    """Rename folder ``src`` to ``dst``, or, ``dst`` existing, move its entries into it (renames)."""
    if not os.path.lexists(dst):
        os.rename(src, dst)
        return
    for name in sorted(os.listdir(src), key=lambda n: (n in last, n)):
        inner, target = os.path.join(src, name), os.path.join(dst, name)
        if os.path.isdir(inner) and os.path.isdir(target) and not os.path.islink(target):
            _move_into(inner, target, ())
        else:
            os.replace(inner, target)
    os.rmdir(src)
