"""A stand-in child for process-spawning code under test (benchmarks/bench_ckpt.py's ``spawn``), in a
module of its own that imports nothing heavy: a ``spawn`` child imports the module of its target, and
torch would cost it seconds before it could crash."""

import os
import time


def crashing_rank(rank, world, port, argv, fmt, folder, results):
    """A bench_ckpt child: rank 1 dies without reporting, rank 0 waits (as for it, in a collective)."""
    if rank == 1:
        os._exit(7)
    time.sleep(300)
