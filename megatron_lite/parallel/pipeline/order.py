"""The order in which each pipeline rank runs its forward and backward passes (pure Python).

The real schedules in :mod:`schedules` and the process-free simulator in :mod:`trace` both take
their op order from here, so a drawn schedule is the schedule that runs. An op is a tuple
``(kind, microbatch, chunk)`` with kind ``"F"`` (forward), ``"B"`` (backward; with the zero-bubble
schedules only the input-gradient half) or ``"W"`` (the deferred weight-gradient half, zero-bubble
only); ``chunk`` is the model chunk (virtual pipeline stage) on this rank, always 0 without
interleaving.

Notation: ``p`` pipeline ranks, ``r`` this rank, ``m`` micro-batches, ``v`` model chunks per rank.
Micro-batch ``mb`` on chunk ``c`` of rank ``r`` is virtual stage ``c * p + r`` of ``v * p``.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

Op = tuple[str, int, int]


# ---------------------------------------------------------------------------------------------
# Non-interleaved 1F1B (PipeDream-Flush).


def warmup_1f1b(p: int, r: int, m: int) -> int:
    """Forwards rank ``r`` runs before its first backward: the later stages still have to fill.

    The last rank starts its first backward right after its first forward (0 warmup); rank ``r``
    must first push ``p - r - 1`` more micro-batches into the pipe so the stages after it are busy.
    """
    return min(p - r - 1, m)


def order_1f1b(p: int, r: int, m: int) -> list[Op]:
    """Warmup forwards, then alternate one forward / one backward, then the remaining backwards."""
    warm = warmup_1f1b(p, r, m)
    ops: list[Op] = [("F", i, 0) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i, 0), ("B", i, 0)]
    ops += [("B", i, 0) for i in range(m - warm, m)]
    return ops


def order_no_pipelining(m: int) -> list[Op]:
    """One stage: forward and backward of each micro-batch in turn."""
    ops: list[Op] = []
    for i in range(m):
        ops += [("F", i, 0), ("B", i, 0)]
    return ops


# ---------------------------------------------------------------------------------------------
# ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", the variant with 1F1B's memory).
#
# Each backward is split into B (gradient of the stage input: the previous stage waits for it) and
# W (weight gradients: nobody waits for them). The F/B skeleton is exactly 1F1B's; rank r holds
# back its last r W passes and runs them where 1F1B idles waiting for gradients in the cooldown.
# A micro-batch stays in flight from its F until its W (W needs the stashed GEMM inputs and output
# gradients), so rank r holds at most (p - r - 1) + 1 + r = p of them: the peak of 1F1B's rank 0.


def zb_h1_deferred(p: int, r: int) -> int:
    """W passes rank ``r`` keeps pending after each B: ``r`` (the later the rank, the longer its
    1F1B cooldown wait, and the fewer micro-batches 1F1B keeps in flight there)."""
    return r


def order_zb_h1(p: int, r: int, m: int) -> list[Op]:
    """1F1B's F/B order; after each B, the oldest W runs while more than ``r`` are pending; the
    pending ones run after the last B."""
    ops: list[Op] = []
    pending = 0
    keep = zb_h1_deferred(p, r)
    for op in order_1f1b(p, r, m):
        ops.append(op)
        if op[0] == "B":
            pending += 1
            if pending > keep:
                ops.append(("W", op[1] - keep, 0))
                pending -= 1
    ops += [("W", i, 0) for i in range(m - pending, m)]
    return ops


# ---------------------------------------------------------------------------------------------
# Interleaved 1F1B (Narayanan et al. 2021, Megatron's ordering).
#
# Every rank runs its forwards in the same order: micro-batches are taken in groups of p, and each
# group passes through chunk 0, then chunk 1, ..., then chunk v-1 before the next group starts.
# Backwards use the same grouping with the chunks reversed (v-1 first). The k-th forward (or
# backward) of a rank is therefore a pure function of k, which is what keeps neighbouring ranks'
# sends and receives in step.


def interleaved_forward_op(k: int, p: int, v: int) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward on any rank."""
    group, within = divmod(k, p * v)
    return group * p + within % p, within // p


def interleaved_backward_op(k: int, p: int, v: int) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th backward on any rank (chunks visited last to first)."""
    mb, chunk = interleaved_forward_op(k, p, v)
    return mb, v - 1 - chunk


def check_interleaved_microbatches(m: int, p: int) -> None:
    """The interleaved schedules (1F1B and zero bubble) need m to be a multiple of p (Megatron's
    original constraint).

    Forwards go through the chunks in groups of p micro-batches, so a partial group would leave
    the ranks' send/receive sequences out of step.
    """
    if m < 1 or m % p:
        raise ValueError(
            f"the interleaved pipeline schedule needs the number of micro-batches per step "
            f"(--global-batch-size / (--micro-batch-size x data-parallel size)) = {m} to be a positive "
            f"multiple of --pipeline-model-parallel-size {p}; change --global-batch-size or "
            f"--micro-batch-size, or drop --num-layers-per-virtual-pipeline-stage (or the virtual stages of "
            f"--pipeline-model-parallel-layout)"
        )


def warmup_interleaved(p: int, r: int, m: int, v: int) -> int:
    """Forwards before the first backward on rank ``r`` (counted over all chunks).

    Rank ``r`` must fill chunks 0..v-2 for one group of p micro-batches ((v-1)*p forwards) and then
    stay 2*(p-r-1) forwards ahead of the last rank, which needs its inputs to travel down and its
    gradients back up. With exactly p micro-batches there is no steady state: everything is warmup.
    """
    total = m * v
    if m == p:
        return total
    return min((p - r - 1) * 2 + (v - 1) * p, total)


def order_interleaved(p: int, r: int, m: int, v: int) -> list[Op]:
    check_interleaved_microbatches(m, p)
    total, warm = m * v, warmup_interleaved(p, r, m, v)
    ops: list[Op] = [("F", *interleaved_forward_op(k, p, v)) for k in range(warm)]
    for k in range(total - warm):
        ops.append(("F", *interleaved_forward_op(warm + k, p, v)))
        ops.append(("B", *interleaved_backward_op(k, p, v)))
    ops += [("B", *interleaved_backward_op(k, p, v)) for k in range(total - warm, total)]
    return ops


# ---------------------------------------------------------------------------------------------
# Interleaved zero bubble: ZB-H1's B/W split on interleaved 1F1B (--pipeline-schedule zb-h1 with
# virtual stages; the idea of Qi et al.'s interleaved zero-bubble schedules, built here as follows).
#
# The F/B order of every rank is exactly order_interleaved's (so are the sends and receives); only W
# ops are added, first in first out (a W runs the oldest pending micro-batch-chunk's weight
# gradients, as WeightGradStore.flush does). Where each W goes is decided by laying all ranks on a
# timeline of unit slots (F = B = W = one slot, communication free), slot by slot:
#   - before an F that would put more micro-batch-chunks in flight (forward done, W not yet) than
#     interleaved 1F1B's largest count -- its first rank's: (v+1)p - 1 when m > p, v*p when m == p --
#     the oldest W runs instead (so every rank stays within that bound: interleaved 1F1B's peak);
#   - otherwise the next F/B runs when its input (or output gradient) is there;
#   - when it is not, a pending W runs in the slot the rank would otherwise wait (the warmup's and
#     cooldown's bubbles, and any wait of the steady phase);
#   - after the last B the remaining W passes run.
# A W never delays an F/B whose input is there, so F and B run no later than in interleaved 1F1B with
# its backward as one op; at equal F, B and W costs the simulated bubble is a third of interleaved
# 1F1B's, (p-1)/(3vm), once m >= 2p (tests/unit/test_zero_bubble_interleaved.py).


def _stage_dependency(kind: str, mb: int, stage: int, stages: int):
    """The (kind, micro-batch, virtual stage) an F or B op waits for (as trace.simulate's)."""
    if kind == "F":
        return ("F", mb, stage - 1) if stage > 0 else None
    return ("B", mb, stage + 1) if stage < stages - 1 else ("F", mb, stage)


def zb_interleaved_bound(p: int, m: int, v: int) -> int:
    """Most micro-batch-chunks in flight on any rank under interleaved zero bubble: interleaved 1F1B's
    largest count (its first rank's warmup forwards plus one, or all m*v when m == p)."""
    return min(warmup_interleaved(p, 0, m, v) + 1, m * v)


@lru_cache(maxsize=64)
def _zb_interleaved_orders(p: int, m: int, v: int) -> tuple[tuple[Op, ...], ...]:
    """The op order of every rank (see the section comment), from a unit-slot timeline of all ranks."""
    skeleton = [order_interleaved(p, r, m, v) for r in range(p)]
    bound, stages = zb_interleaved_bound(p, m, v), p * v
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, virtual stage) -> slot it ended
    orders: list[list[Op]] = [[] for _ in range(p)]
    nxt, live = [0] * p, [0] * p  # next F/B op; micro-batch-chunks in flight (F done, W not yet)
    pending: list[deque] = [deque() for _ in range(p)]  # (micro-batch, chunk) whose B ran, W not yet
    slot = 0
    while any(nxt[r] < len(skeleton[r]) or pending[r] for r in range(p)):
        ran = []
        for r in range(p):
            op = None
            if nxt[r] < len(skeleton[r]):
                kind, mb, chunk = skeleton[r][nxt[r]]
                dep = _stage_dependency(kind, mb, chunk * p + r, stages)
                ready = dep is None or done.get(dep, slot + 1) <= slot
                if not (kind == "F" and live[r] >= bound and pending[r]) and ready:
                    op, nxt[r] = skeleton[r][nxt[r]], nxt[r] + 1
                    live[r] += kind == "F"
                    if kind == "B":
                        pending[r].append((mb, chunk))
            if op is None and pending[r]:
                op = ("W", *pending[r].popleft())
                live[r] -= 1
            if op is not None:
                orders[r].append(op)
                ran.append((op, r))
        for (kind, mb, chunk), r in ran:
            done[(kind, mb, chunk * p + r)] = slot + 1
        slot += 1
    return tuple(tuple(o) for o in orders)


def order_zb_interleaved(p: int, r: int, m: int, v: int) -> list[Op]:
    """Rank ``r``'s interleaved zero-bubble order: interleaved 1F1B's F/B order with W ops added."""
    check_interleaved_microbatches(m, p)
    return list(_zb_interleaved_orders(p, m, v)[r])


SCHEDULES = ("1f1b", "zb-h1")
"""Values of --pipeline-schedule: "1f1b" (1F1B, interleaved with virtual stages) or "zb-h1" (zero
bubble: ZB-H1, interleaved zero bubble with virtual stages)."""


def rank_order(p: int, r: int, m: int, v: int = 1, schedule: str = "1f1b") -> list[Op]:
    """The op order of rank ``r`` for the schedule get_forward_backward_func picks for (p, v, schedule)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if p == 1:
        return order_no_pipelining(m)
    if schedule == "zb-h1":
        return order_zb_interleaved(p, r, m, v) if v > 1 else order_zb_h1(p, r, m)
    return order_interleaved(p, r, m, v) if v > 1 else order_1f1b(p, r, m)
