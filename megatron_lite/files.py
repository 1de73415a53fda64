"""Writing a file whole: under a temporary name next to it, renamed over it once complete.

A write that fails (a full disk, an error in the data being written) or is interrupted removes the
temporary file and leaves the target as it was: nothing half-written is ever left on disk, under
either name.
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
