"""Keep freed host memory in the process, so a CPU training step stops paying for page faults.

glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
returns it to the kernel on ``free``; freed heap above 128 KiB at the top is trimmed back too. A
CPU training step allocates and frees the same large tensors every step (logits of
``tokens x vocab``, attention scores of ``heads x seq x seq``), so each step the kernel maps and
zeroes the same pages again: on a 2-core machine, a GPT step of the issue's size spent a third
of its CPU time in the kernel handling half a million minor page faults.

:func:`retain_freed_host_memory` asks glibc (``mallopt``) to serve large blocks from the heap
and never trim it, as a caching allocator would: after the first step, a step touches no new
pages. The process's resident memory then stays at its peak instead of shrinking between steps.
``--no-retain-host-memory`` leaves the C library as it is. Only glibc has ``mallopt`` with these
meanings; elsewhere nothing is changed.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_MAX = -4
_LARGEST_INT = 2**31 - 1  # mallopt takes an int: trim only when more than 2 GiB is free at the heap's top


def _glibc_mallopt():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process runs on
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl's mallopt is a stub
            return None
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def retain_freed_host_memory() -> bool:
    """Large blocks come from the heap (no per-block mmap) and the heap is not trimmed; returns
    whether glibc accepted both settings. Process-wide and lasting: call once at start-up."""
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _LARGEST_INT))


def minor_page_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is missing: not a Unix)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
