"""Schedule traces: what each pipeline rank ran, in order, and what that costs under equal stage times.

A trace is a list of :class:`Event` ``(rank, step, kind, microbatch, chunk)`` — ``rank`` is the
pipeline rank, ``step`` the position of the op in that rank's execution order, ``kind`` ``"F"``,
``"B"`` or ``"W"`` (zero-bubble schedule: B is then only the input gradient, W the weight gradients). The schedules append to a list passed as ``trace=``; pass a :class:`Trace` to also record
wall-clock (start, end) times of each op.

:func:`simulate` lays per-rank op orders on a timeline under equal stage costs, without processes:
an op starts when its rank is free and its input is ready (forward of micro-batch i on virtual
stage s needs the forward of i on stage s-1; its backward needs the backward of i on stage s+1),
a W needs the B of the same micro-batch and stage; communication is free. From a timeline, :func:`bubble_fraction` is idle time over busy time summed
over ranks — the definition behind the formulas (p-1)/m (1F1B) and (p-1)/(v*m) (interleaved,
chunk costs 1/v of a stage) — and :func:`render_grid` prints rows = ranks, columns = time slots.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from .order import rank_order


class Event(NamedTuple):
    rank: int
    step: int
    kind: str  # "F", "B" or "W" (the deferred weight gradients of the zero-bubble schedule)
    microbatch: int
    chunk: int


class Trace(list):
    """A list of events that also keeps each op's wall-clock ``(start, end)`` in ``times``, read from
    ``clock`` (default ``time.perf_counter``; the straggler detector passes one that synchronises the GPU,
    a test a fake one)."""

    def __init__(self, *args, clock=time.perf_counter):
        super().__init__(*args)
        self.times: list[tuple[float, float]] = []
        self.clock = clock


class _Recorder:
    """Used by the schedules: ``with rec.op("F", mb, chunk): ...`` appends one event."""

    def __init__(self, trace, rank: int):
        self.trace, self.rank, self.step = trace, rank, 0

    def op(self, kind: str, microbatch: int, chunk: int):
        return _OpTimer(self, kind, microbatch, chunk)


class _OpTimer:
    def __init__(self, rec, kind, microbatch, chunk):
        self.rec, self.event = rec, (kind, microbatch, chunk)

    def __enter__(self):
        trace = self.rec.trace
        self.clock = trace.clock if isinstance(trace, Trace) else time.perf_counter
        self.t0 = self.clock()

    def __exit__(self, *exc):
        rec = self.rec
        if rec.trace is None or exc[0] is not None:
            return
        rec.trace.append(Event(rec.rank, rec.step, *self.event))
        if isinstance(rec.trace, Trace):
            rec.trace.times.append((self.t0, self.clock()))
        rec.step += 1


def orders_from_trace(events) -> dict[int, list[tuple[str, int, int]]]:
    """Per-rank op order ``{rank: [(kind, microbatch, chunk), ...]}`` from events of any ranks."""
    out: dict[int, list] = {}
    for e in sorted(events, key=lambda e: (e.rank, e.step)):
        out.setdefault(e.rank, []).append((e.kind, e.microbatch, e.chunk))
    return out


def simulated_orders(p: int, m: int, v: int = 1, schedule: str = "1f1b") -> dict[int, list[tuple[str, int, int]]]:
    """The op order of every rank, from the same functions the schedules use."""
    return {r: rank_order(p, r, m, v, schedule) for r in range(p)}


def _dependency(kind: str, mb: int, stage: int, stages: int):
    """The op that must finish before ``kind`` of ``mb`` on virtual ``stage`` can start."""
    if kind == "F":
        return ("F", mb, stage - 1) if stage > 0 else None
    if kind == "W":  # the weight gradients need this stage's output gradient, i.e. its own B
        return ("B", mb, stage)
    return ("B", mb, stage + 1) if stage < stages - 1 else ("F", mb, stage)


def simulate(orders: dict[int, list], p: int, v: int = 1, f_cost: float = 1.0, b_cost: float = 1.0,
             w_cost: float = 0.0):
    """Start/end time of every op under equal stage costs; returns ``{rank: [(op, start, end)]}``.

    ``b_cost`` is the cost of a B op: the whole backward for orders without W ops, only the
    input-gradient half for zero-bubble orders, whose W ops cost ``w_cost``.
    Raises ValueError if the orders deadlock (some rank waits for an op that never comes first).
    """
    stages = p * v
    cost = {"F": f_cost, "B": b_cost, "W": w_cost}
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, virtual stage) -> end time
    clock = {r: 0.0 for r in orders}
    nxt = {r: 0 for r in orders}
    out: dict[int, list] = {r: [] for r in orders}
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r, ops in orders.items():
            while nxt[r] < len(ops):
                kind, mb, chunk = ops[nxt[r]]
                stage = chunk * p + r
                dep = _dependency(kind, mb, stage, stages)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                end = start + cost[kind]
                done[(kind, mb, stage)] = clock[r] = end
                out[r].append(((kind, mb, chunk), start, end))
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][nxt[r]] for r in orders if nxt[r] < len(orders[r])}
            raise ValueError(f"schedule deadlocks: each rank waits on an op that never runs first: {stuck}")
    return out


def bubble_fraction(timeline: dict[int, list]) -> float:
    """Idle time over busy time, summed over ranks (idle = time before the last op ends, not busy).

    This is the pipeline-bubble definition of Narayanan et al. (bubble time / ideal compute time);
    idle over the whole span is ``b / (1 + b)`` for the returned ``b``.
    """
    span = max(end for ops in timeline.values() for _, _, end in ops)
    busy = sum(end - start for ops in timeline.values() for _, start, end in ops)
    return (span * len(timeline) - busy) / busy


def measured_bubble_fraction(trace: Trace, ranks_span: dict[int, tuple[float, float]] | None = None) -> float:
    """Bubble fraction from wall-clock times: per rank, (step span - time inside F/B ops) / busy.

    ``trace`` holds the events and times of every rank (each rank's own clock); a rank's span runs
    from its first op's start to its last op's end unless ``ranks_span`` gives (start, end) per rank.
    """
    per_rank: dict[int, list] = {}
    for e, t in zip(trace, trace.times):
        per_rank.setdefault(e.rank, []).append(t)
    idle = busy = 0.0
    for r, times in per_rank.items():
        t0, t1 = ranks_span[r] if ranks_span else (min(a for a, _ in times), max(b for _, b in times))
        work = sum(b - a for a, b in times)
        busy += work
        idle += (t1 - t0) - work
    return idle / busy


def peak_in_flight(ops: list[tuple[str, int, int]]) -> int:
    """Most micro-batch activations a rank holds at once: forwards done minus backwards finished.

    A micro-batch's backward finishes with its B op, or with its W op when the order has W ops
    (until then its GEMM inputs and output gradients stay stashed for the weight gradients).
    """
    last = "W" if any(kind == "W" for kind, _, _ in ops) else "B"
    live = peak = 0
    for kind, _, _ in ops:
        live += 1 if kind == "F" else -1 if kind == last else 0
        peak = max(peak, live)
    return peak


def render_grid(timeline: dict[int, list], unit: float = 1.0, show_chunk: bool | None = None) -> str:
    """Text grid: one row per rank, one column per time slot of ``unit``; '.' is idle.

    A cell reads ``F3`` (forward of micro-batch 3), ``B3`` or ``W3``; with several chunks ``F3b`` names the
    chunk by letter (a = chunk 0). An op longer than one slot fills each of its slots.
    """
    if show_chunk is None:
        show_chunk = any(op[2] for ops in timeline.values() for op, _, _ in ops)
    span = max(end for ops in timeline.values() for _, _, end in ops)
    slots = int(round(span / unit))
    rows = []
    for r in sorted(timeline):
        cells = ["." for _ in range(slots)]
        for (kind, mb, chunk), start, end in timeline[r]:
            label = f"{kind}{mb}" + (chr(ord("a") + chunk) if show_chunk else "")
            for s in range(int(round(start / unit)), int(round(end / unit))):
                cells[s] = label
        width = max(4, max(len(c) for c in cells) + 1)
        rows.append(f"rank {r}: " + "".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(rows)
