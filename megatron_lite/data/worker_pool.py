"""The worker pool's two guards, shared by ``preprocess`` and ``preprocess_sft``: a gate that bounds the
chunks in flight (so memory stays bounded however large the input is), and a pool stop that cannot
hang on CPython's ``Pool.terminate``."""

from __future__ import annotations

import threading


class ChunkGate:
    """Iterate ``chunks`` with at most ``limit`` handed out and not yet consumed (bounded memory).

    ``Pool.imap`` pulls its input from a feeder thread as fast as it can; this iterator blocks that
    thread until the main loop has consumed enough results.
    """

    def __init__(self, chunks, limit: int):
        self.chunks, self.slots, self.stopped = iter(chunks), threading.Semaphore(limit), False

    def __iter__(self):
        return self

    def __next__(self):
        self.slots.acquire()
        if self.stopped:
            raise StopIteration
        return next(self.chunks)

    def done_one(self) -> None:
        self.slots.release()

    def stop(self) -> None:
        self.stopped = True
        self.slots.release()


POOL_STOP_SECONDS = 10.0


def stop_pool(pool) -> None:
    """``pool.terminate()`` and ``join()``, waiting at most ``POOL_STOP_SECONDS``: CPython's ``terminate`` stops
    the workers reading their task pipe, then waits for the pool's task-feeding thread, forever when
    that thread is part-way through writing a task larger than the pipe's buffer (seen after an error
    or Ctrl-C with ``--workers 2``). The workers are already terminated then; we leave that thread."""
    closer = threading.Thread(target=pool.terminate, daemon=True, name="preprocess-pool-terminate")
    closer.start()
    closer.join(POOL_STOP_SECONDS)
    if not closer.is_alive():
        pool.join()
