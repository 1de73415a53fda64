"""What every rank must agree on to stop: a SIGTERM seen by one rank, any rank's flag (one all-reduce)."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from ..device import get_device


class ExitSignal:
    """Remembers a SIGTERM so the loop can save a checkpoint and exit cleanly at the step boundary."""

    def __init__(self, enabled: bool):
        self.received, self.enabled = False, enabled
        self.previous = signal.signal(signal.SIGTERM, self._handle) if enabled else None

    def _handle(self, signum, frame):
        self.received = True

    def close(self) -> None:
        """Give the process its own SIGTERM handler back: after the run a SIGTERM does what it did before."""
        if self.enabled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self.previous is None else self.previous)


def any_rank(flags: list[bool]) -> list[bool]:
    """Each flag, true when it is true on any rank (so every rank takes the same decision)."""
    if not dist.is_initialized():
        return list(flags)
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=get_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]
