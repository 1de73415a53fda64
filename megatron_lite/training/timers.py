"""Named wall-clock timers for the training loop (iteration time, forward-backward, optimizer, ...).

A timer accumulates the time between ``start()`` and ``stop()`` calls. On a CUDA device both
synchronise the device first, so the time covers the kernels launched in between rather than just
their launch; on the CPU nothing needs synchronising. ``barrier=True`` also waits for every rank of
the default process group, so the slowest rank's time is the one measured.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..device import get_device


def _synchronize() -> None:
    if get_device().type == "cuda":
        torch.cuda.synchronize()


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class Timer:
    """One named timer: ``start``/``stop`` pairs add up into ``elapsed``."""

    def __init__(self, name: str):
        self.name = name
        self._total = 0.0
        self._started_at: float | None = None

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def start(self, barrier: bool = False) -> None:
        if self.running:
            raise RuntimeError(f"timer {self.name!r} is already running")
        if barrier:
            _barrier()
        _synchronize()
        self._started_at = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if not self.running:
            raise RuntimeError(f"timer {self.name!r} was stopped without being started")
        if barrier:
            _barrier()
        _synchronize()
        self._total += time.perf_counter() - self._started_at
        self._started_at = None

    def reset(self) -> None:
        self._total = 0.0
        self._started_at = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (including a running interval); optionally start again from 0.

        A running timer keeps running across ``elapsed(reset=True)``: only its accumulated total is
        cleared and its interval restarts now.
        """
        total = self._total
        if self.running:
            _synchronize()
            now = time.perf_counter()
            total += now - self._started_at
            if reset:
                self._started_at = now
        if reset:
            self._total = 0.0
        return total


class Timers:
    """A dict of :class:`Timer` created on first use: ``timers("interval-time").start()``."""

    def __init__(self):
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(name)
        return self._timers[name]

    def names(self) -> list[str]:
        return list(self._timers)

    def elapsed(self, names=None, reset: bool = True) -> dict[str, float]:
        """Seconds of each named timer (all timers when ``names`` is None)."""
        names = self.names() if names is None else names
        return {name: self(name).elapsed(reset=reset) for name in names}

    def log_string(self, names=None, normalizer: float = 1.0, reset: bool = True) -> str:
        """``"time (ms) | forward-backward: 12.34 | optimizer: 1.23"``, times divided by ``normalizer``."""
        parts = [f"{n}: {1000.0 * s / normalizer:.2f}" for n, s in self.elapsed(names, reset).items()]
        return "time (ms) | " + " | ".join(parts)
