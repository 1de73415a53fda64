"""Communication volume: the bytes each rank sends, per kind of group, per training step.

Every collective and point-to-point transfer of the parallel layers reports here through
:func:`record` (``megatron_lite.parallel.comm`` and the data-parallel, distributed-optimizer and
pipeline code call it). Nothing is recorded unless a :class:`CommVolume` is active
(``with volume.counting(): ...``, which the training loop opens around each step under
``--log-comm-volume``): off, :func:`record` is one context-variable lookup and a None check.
The active counter is context-local (:mod:`contextvars`), not a process-wide singleton; a
thread that does not share that context, as the autograd engine's device threads (where a GPU
backward pass runs the backward of the parallel layers and the gradient hooks) do not, counts into
the counter the process opened last and still holds open.

Bytes are what one rank sends over the link under the ring algorithms (``n`` = bytes of the
full tensor, ``g`` = group size): all-reduce ``2 (g-1)/g n``; all-gather and reduce-scatter
``(g-1)/g n``; all-to-all the rows it sends to other ranks; a point-to-point send ``n``. They are
kept as exact fractions so tests can compare them with closed forms exactly.

Kinds: ``tp`` (tensor-parallel all-reduces / gathers of the hidden dim, including the
vocab-parallel cross-entropy's), ``sp`` (sequence-parallel gathers and reduce-scatters, and the
all-reduce of the sequence-parallel parameters' gradients), ``cp`` (context-parallel attention: the
ring's key/value and dK/dV sends, the Ulysses all-to-alls, the key/value all-gathers), ``ep`` (MoE
token dispatch: the all-to-all or all-gather of tokens, routing weights and routing metadata),
``dp`` (gradient all-reduce / reduce-scatter and the distributed optimizer's parameter
all-gather), ``pp`` (stage-to-stage activations and gradients, and the tied-embedding gradient
all-reduce between the first and last stage).

Not counted: scalar control collectives (gradient-norm and inf checks, the logged loss average,
exit flags), a few bytes per step each.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from contextvars import ContextVar
from fractions import Fraction

KINDS = ("tp", "sp", "cp", "ep", "dp", "pp")

_ACTIVE: ContextVar[CommVolume | None] = ContextVar("megatron_lite_comm_volume", default=None)
_OPEN: list[CommVolume] = []  # every counting() block still open in this process, the latest last


def ring_bytes(op: str, nbytes: int, group_size: int) -> Fraction:
    """Bytes one rank sends for ``op`` on ``nbytes`` of data (the full tensor; for all-gather the
    gathered output) over ``group_size`` ranks."""
    g = group_size
    if op == "all_reduce":
        return Fraction(2 * (g - 1) * nbytes, g)
    if op in ("all_gather", "reduce_scatter"):
        return Fraction((g - 1) * nbytes, g)
    if op in ("send", "all_to_all"):
        return Fraction(nbytes)
    raise ValueError(f"unknown communication op {op!r}")


def record(kind: str, op: str, nbytes: int, group_size: int) -> None:
    """Count one operation on the active :class:`CommVolume`, if any (see :func:`ring_bytes`)."""
    volume = _ACTIVE.get() or (_OPEN[-1] if _OPEN else None)  # another thread: autograd's device threads
    if volume is not None:
        volume.add(kind, op, ring_bytes(op, nbytes, group_size))


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


class CommVolume:
    """Bytes sent by this rank, per kind and op, for the current step and every finished step."""

    def __init__(self):
        self.current: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        self.steps: list[dict[tuple[str, str], Fraction]] = []

    def add(self, kind: str, op: str, nbytes: Fraction) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown group kind {kind!r}; one of {', '.join(KINDS)}")
        self.current[(kind, op)] += nbytes

    @contextmanager
    def counting(self):
        """Record every communication in the block into this counter."""
        token = _ACTIVE.set(self)
        _OPEN.append(self)
        try:
            yield self
        finally:
            _OPEN.remove(self)
            _ACTIVE.reset(token)

    def end_step(self) -> dict[tuple[str, str], Fraction]:
        """Close the current step; returns its counts ``{(kind, op): bytes}``."""
        done = dict(self.current)
        self.steps.append(done)
        self.current = defaultdict(Fraction)
        return done

    @staticmethod
    def per_kind(counts: dict[tuple[str, str], Fraction]) -> dict[str, Fraction]:
        out = {k: Fraction(0) for k in KINDS}
        for (kind, _), nbytes in counts.items():
            out[kind] += nbytes
        return out

    @staticmethod
    def format(counts: dict[tuple[str, str], Fraction]) -> str:
        """``comm MB sent: tp 1.23 | dp 4.56`` (kinds with traffic only)."""
        parts = [f"{k} {float(v) / 1e6:.3f}" for k, v in CommVolume.per_kind(counts).items() if v]
        return "comm MB sent: " + (" | ".join(parts) if parts else "none")
