"""The server with continuous batching (``--inference-max-requests`` > 1): concurrent requests
decode together in one batch (:class:`~.scheduler.Scheduler`).

On rank 0 the HTTP server answers every request in its own thread; the main thread runs the
engine. A handler thread hands its request over (:class:`Ticket`) and waits for its result, or
for each step's tokens when it streams; the main thread, between two decode steps, admits the
requests that arrived (they join the batch at the next step), runs one step of the batch and
hands every request its step, its results when it ends (it leaves the batch and frees its rows)
or its error. Under torchrun every step is preceded by one broadcast from rank 0 naming the
requests that join (their token ids and sampling parameters), so the followers run the same
steps (:meth:`BatchRunner.on_message`).

The batch runs OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, streamed or not, and
Megatron's ``PUT /api`` (its prompts are one request's sequences, as in the one-at-a-time engine's
static batch: the same answer), with up to ``--inference-max-requests`` sequences at once (a request
holds one per prompt, times ``n`` or ``best_of``; one that does not fit waits for rows and
key/value-cache blocks to free up, in arrival order; one whose blocks exceed the whole cache,
``--inference-kv-cache-blocks``, is refused with HTTP 400), prefills chunked within
``--max-num-batched-tokens`` per step. What the batch does not cover runs alone as before, between
two steps of the batch (which waits meanwhile): beam search, scoring (``max_tokens`` 0,
``tokens_to_generate`` 0), a request of more sequences than the bound, and every request under
``--no-kv-cache``. With ``--num-speculative-tokens`` (the engine a
:class:`~.speculative.SpeculativeEngine`) every request speculation serves runs alone too, drafts
and all (several prompts, or ``n`` > 1, as one speculative batch; queued requests of equal
parameters together: :func:`run_together`); the others (stop strings, penalties, ...) batch as before.

A streaming client that leaves cancels its request: it leaves the batch at the next step (the
step's broadcast names it, so every rank drops it) and frees its rows and blocks. A speculative
request running alone stops at its next verify step (:meth:`.SpeculativeEngine.stream`'s
``cancelled``); the other requests run alone run to their end (their answer is dropped).

SIGTERM / Ctrl-C: the server stops accepting requests, finishes those it holds, then stops every
rank (exit code 0).
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import torch.distributed as dist

from .engine import Step
from .scheduler import Scheduler
from .server import _GENERATE, HEARTBEAT_S, Runner, cancel_args

_STEP = "step"


class Steps:
    """A ticket's steps, read like :meth:`InferenceEngine.stream <.engine.InferenceEngine.stream>`'s
    generator: each step, then ``StopIteration`` holding the results (or the request's error).
    :meth:`cancel` (the streaming client left) makes the request leave the batch at the next step."""

    def __init__(self, ticket: Ticket, on_cancel=None):
        self.ticket, self.on_cancel, self.finished = ticket, on_cancel, False

    def __iter__(self):
        return self

    def __next__(self):
        while not self.finished:
            kind, value = self.ticket.items.get()
            if kind == "step":
                return value
            if kind == "started":
                continue
            self.finished = True
            if kind == "error":
                raise value
            raise StopIteration(value)
        raise StopIteration(None)

    def cancel(self) -> None:
        if not self.finished and self.on_cancel is not None:
            self.on_cancel()
            self.on_cancel = None  # once


class Ticket:
    """One request handed to the engine's thread: its steps, then its results or its error."""

    def __init__(self):
        self.items: queue.Queue = queue.Queue()
        self.rid: int | None = None  # its id in the batch (None: it runs alone)
        self.cancelled = threading.Event()  # run alone: its streaming client left

    def put(self, kind: str, value=None) -> None:
        self.items.put((kind, value))

    def wait_started(self) -> None:
        """Block until the request is accepted (raise its ValueError when it was refused)."""
        kind, value = self.items.get()
        if kind == "error":
            raise value

    def steps(self, on_cancel=None) -> Steps:
        return Steps(self, on_cancel)

    def result(self):
        steps = self.steps()
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value


class BatchRunner(Runner):
    """:class:`~.server.Runner` with continuous batching over at most ``max_requests`` sequences;
    ``cache``: the :class:`~.scheduler.Scheduler`'s block size, number of blocks and tokens per step."""

    batched = True

    def __init__(self, engine, max_requests: int, **cache):
        super().__init__(engine)
        self.batch = Scheduler(engine, max_requests, **cache)
        self.tickets: dict[int, Ticket] = {}
        self.alone: list[tuple] = []  # (prompts, params, ticket) to run one at a time
        self.cancelled: set[int] = set()  # requests whose streaming client left
        self.cond = threading.Condition()

    # -- handler threads -------------------------------------------------------------------------
    def submit(self, prompts, params) -> Ticket:
        """Hand a request to the engine's thread; a request the batch runs is checked here (ValueError)."""
        ticket = Ticket()
        with self.cond:
            speculates = getattr(self.engine, "speculates", None)  # a SpeculativeEngine's requests run alone
            drafts = speculates is not None and speculates(prompts, params)
            if not drafts and self.batch.covers(prompts, params):
                if speculates is not None:  # served without drafts: the engine counts it
                    self.engine.served["fell_back"] += 1
                ticket.rid = self.batch.add(prompts, params)
                self.tickets[ticket.rid] = ticket
                ticket.put("started")
            else:  # the engine's thread checks it (ValueError) when it runs it
                self.alone.append((prompts, params, ticket))
            self.cond.notify()
        return ticket

    def run(self, prompts, params):
        ticket = self.submit(prompts, params)
        ticket.wait_started()
        return ticket.result()

    def stream(self, prompts, params):
        ticket = self.submit(prompts, params)
        ticket.wait_started()
        return ticket.steps(on_cancel=ticket.cancelled.set if ticket.rid is None else lambda: self.cancel(ticket.rid))

    def cancel(self, rid: int) -> None:
        """The client of request ``rid`` left: it leaves the batch (or the queue) at the next step."""
        with self.cond:
            self.cancelled.add(rid)
            self.cond.notify()

    # -- the engine's thread (rank 0) ------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.alone or self.batch.busy)

    def work(self) -> bool:
        """Run one request alone or one step of the batch; False when there was nothing to do."""
        with self.cond:
            job = self.alone.pop(0) if self.alone else None
            group = self._joining(job) if job is not None else []
            leaving = self._leaving() if job is None else []  # first: a cancelled queued request is not admitted
            admitted = self.batch.admissions() if job is None else []
        if group:
            run_together(self, [job] + group)
            return True
        if job is not None:
            self._run_alone(*job)
            return True
        if not admitted and not self.batch.active:
            return False
        self._send((_STEP, admitted, leaving))
        try:
            events = self.batch.step(admitted, leaving)
        except Exception as err:  # noqa: BLE001 - every request in the batch fails; the server serves on
            for rid in sorted(set(self.batch.fail_all()) | {a.rid for a in admitted} | set(leaving)):
                self.tickets.pop(rid).put("error", err)
            return True
        for rid in leaving:
            self.tickets.pop(rid).put("done", None)
        for event in events:
            ticket = self.tickets[event.rid]
            if event.step is not None:
                ticket.put("step", event.step)
            if event.error is not None or event.results is not None:
                self.tickets.pop(event.rid)
                ticket.put(*(("error", event.error) if event.error is not None else ("done", event.results)))
        return True

    def _joining(self, job) -> list[tuple]:
        """The queued speculative requests that run in one batch with ``job`` (with the lock held): of
        equal sampling parameters, within the batch's sequences (:meth:`.SpeculativeEngine.joinable`)."""
        joinable = getattr(self.engine, "joinable", None)
        if joinable is None or not joinable(job[0], job[1]):
            return []
        group, size = [], len(job[0])
        for other in list(self.alone):
            if other[1] == job[1] and size + len(other[0]) <= self.batch.cache.max_rows and joinable(*other[:2]):
                self.alone.remove(other)
                group.append(other)
                size += len(other[0])
        return group

    def _leaving(self) -> list[int]:
        """The cancelled requests in the batch (with the lock held); those still queued are dropped."""
        active = {r.rid for r in self.batch.active}
        for a in [a for a in self.batch.pending if a.rid in self.cancelled]:
            self.batch.pending.remove(a)
            self.tickets.pop(a.rid).put("done", None)
        leaving = sorted(self.cancelled & active)
        self.cancelled.clear()
        return leaving

    def _run_alone(self, prompts, params, ticket: Ticket) -> None:
        self._send((_GENERATE, prompts, params))
        try:
            steps = self.engine.stream(prompts, params, **cancel_args(self.engine, ticket.cancelled))
        except Exception as err:  # noqa: BLE001 - a ValueError is the request's 400
            ticket.put("error", err)
            return
        ticket.put("started")
        try:
            while True:
                ticket.put("step", next(steps))
        except StopIteration as end:
            ticket.put("done", end.value)
        except Exception as err:  # noqa: BLE001 - the request's 500 (every rank raised it)
            ticket.put("error", err)

    def serve(self, server, stop) -> None:
        """Serve HTTP in threads and run the engine here until ``stop`` is set and the requests in
        hand are done; then tell the followers to exit."""
        http = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True)
        http.start()
        last, accepting = time.monotonic(), True
        in_flight = getattr(server, "in_flight", None)  # requests accepted and not yet answered
        try:
            while accepting or self.busy or (in_flight is not None and in_flight.count):
                if accepting and stop.set:
                    server.shutdown()  # no new requests; those in hand finish
                    accepting = False
                if self.work():
                    last = time.monotonic()
                    continue
                with self.cond:  # a request handed over since work() looked is not waited for
                    if not self.busy and not self.cancelled:
                        self.cond.wait(0.5)
                if time.monotonic() - last > HEARTBEAT_S:
                    self.heartbeat()
                    last = time.monotonic()
        finally:
            if accepting:
                server.shutdown()
            self.stop()
            server.server_close()
            cache = self.batch.cache
            if cache.prefix_caching:
                print(f"prefix cache: {cache.reused_tokens} prompt tokens reused instead of prefilled, "
                      f"{cache.evicted_blocks} cached blocks evicted", flush=True)

    # -- followers -------------------------------------------------------------------------------
    def on_message(self, message) -> None:
        if message[0] != _STEP:
            return super().on_message(message)
        try:
            events = self.batch.step(*message[1:])
        except Exception as err:  # noqa: BLE001 - rank 0 fails the same requests and serves on
            self.batch.fail_all()
            print(f"rank {dist.get_rank()}: batch step failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            return
        for event in events:  # one request failed alone: rank 0 answers it, the batch goes on
            if event.error is not None:
                print(f"rank {dist.get_rank()}: request {event.rid} failed: {type(event.error).__name__}: "
                      f"{event.error}", file=sys.stderr, flush=True)


def run_together(runner: BatchRunner, jobs: list[tuple]) -> None:
    """Several speculative requests ``(prompts, params, ticket)`` of equal parameters as one batch:
    each ticket gets its sequences' share of every step and its results; a ticket whose streaming
    client left stops its sequences at the next verify step (the others go on)."""
    prompts, params = [p for job in jobs for p in job[0]], jobs[0][1]
    bounds = [0]
    for job in jobs:
        bounds.append(bounds[-1] + len(job[0]))
    spans = list(zip(bounds, bounds[1:]))

    def cancelled():
        return {r for (a, b), job in zip(spans, jobs) if job[2].cancelled.is_set() for r in range(a, b)}

    runner._send((_GENERATE, prompts, params))
    try:
        steps = runner.engine.stream(prompts, params, cancelled=cancelled)
    except Exception as err:  # noqa: BLE001 - checked when queued: not expected
        for job in jobs:
            job[2].put("error", err)
        return
    runner.engine.served["requests"] += len(jobs) - 1  # the engine counts one
    for job in jobs:
        job[2].put("started")
    try:
        while True:
            step = next(steps)
            for (a, b), job in zip(spans, jobs):
                job[2].put("step", Step(step[a:b]))
    except StopIteration as end:
        for (a, b), job in zip(spans, jobs):
            job[2].put("done", end.value[a:b])
    except Exception as err:  # noqa: BLE001 - every request's 500 (every rank raised it)
        for job in jobs:
            job[2].put("error", err)


def make_runner(engine, max_requests: int, **cache) -> Runner:
    """The server's runner: continuous batching over ``max_requests`` sequences (``cache``: see
    :class:`BatchRunner`), or one request at a time when that is 1 or the engine runs without its
    key/value cache (``--no-kv-cache``)."""
    if max_requests > 1 and engine.use_cache:
        return BatchRunner(engine, max_requests, **cache)
    return Runner(engine)
