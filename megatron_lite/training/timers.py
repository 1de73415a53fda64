"""Per-phase timers of a training iteration (``--timing-log-level``, ``--log-timers-to-tensorboard``).

Level 0 (the default) times nothing beyond the iteration time already in the log line. Level 1
times the phases of every iteration, Megatron's names: ``forward-backward`` (all micro-batches
through the pipeline schedule), ``batch-generator`` (waiting for the data iterator, inside
forward-backward), ``all-grads-sync`` (finishing the data-parallel gradient reduction) and
``optimizer`` (unscale, clip, step). Level 2 adds the scheduler step (``lr-scheduler``). Every log
interval the logging rank prints this rank's mean per iteration in milliseconds, and with
``--log-timers-to-tensorboard`` writes ``<name>-time`` scalars (milliseconds) to TensorBoard/W&B.

A phase on a GPU is closed with a device synchronisation so that it measures the kernels it
launched, not their launch; that costs a little overlap, which is why timing is off by default.
"""

from __future__ import annotations

import contextlib
import time

import torch

PHASE_LEVELS = {"forward-backward": 1, "batch-generator": 1, "all-grads-sync": 1, "optimizer": 1,
                "lr-scheduler": 2}


class Timers:
    """Accumulates seconds per phase name until :meth:`take`; phases above ``level`` cost nothing."""

    def __init__(self, level: int, device: torch.device):
        self.level = level
        self.sync = device.type == "cuda"
        self.totals: dict[str, float] = {}
        self.iterations = 0

    def enabled(self, name: str) -> bool:
        return self.level >= PHASE_LEVELS[name]

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled(name):
            yield
            return
        start = self._now()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + self._now() - start

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def timed_iterator(self, iterator):
        """``iterator`` with the time spent in ``next`` counted as ``batch-generator``."""
        if iterator is None or not self.enabled("batch-generator"):
            return iterator
        return _TimedIterator(iterator, self)

    def take(self) -> dict[str, float]:
        """Mean milliseconds per iteration of each phase since the last call; then reset."""
        out = {name: 1000.0 * total / max(1, self.iterations) for name, total in self.totals.items()}
        self.totals, self.iterations = {}, 0
        return out


class _TimedIterator:
    def __init__(self, iterator, timers: Timers):
        self.iterator, self.timers = iterator, timers

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()  # host-side wait for data: no device synchronisation needed
        try:
            return next(self.iterator)
        finally:
            self.timers.add("batch-generator", time.perf_counter() - start)


def format_timers(times: dict[str, float]) -> str:
    """The console line: `` time (ms) | forward-backward: 12.34 | optimizer: 1.23 |``."""
    return " time (ms) |" + "".join(f" {name}: {ms:.2f} |" for name, ms in times.items())
