"""Forward/backward schedules over micro-batches: no pipelining, 1F1B, interleaved 1F1B.

``get_forward_backward_func(state)`` picks one; all share one keyword-only signature
``(forward_step_func, data_iterator, model, num_microbatches, comm, forward_only=False,
grad_scale_func=None, no_sync_func=None, trace=None)``:

- ``forward_step_func(data_iterator, model_chunk) -> (output_tensor, loss_func)``; a chunk gets its
  input from the previous stage through ``set_input_tensor`` before the call (None on the first stage).
- On the last stage ``loss_func(output_tensor) -> (loss, reported)``; the schedule divides ``loss`` by
  ``num_microbatches``, applies ``grad_scale_func`` before backward, and returns the ``reported``
  dicts (last stage only; ``[]`` elsewhere).
- ``no_sync_func()`` (or a list, one per chunk) is a context-manager factory that suppresses
  data-parallel gradient reduction; it stays entered until the last backward (of that chunk).
- ``comm`` is the run's :class:`p2p.PipeComm` (activation shape and dtype, built once per run); its
  ``comm.state`` is the ParallelState the schedule follows. The no-pipelining schedule sends nothing
  but takes it too, so the three are interchangeable.
- ``forward_only=True`` runs forwards only (evaluation); ``trace`` (a list) receives one
  :class:`trace.Event` per forward/backward, in execution order.

The op order of each rank comes from :mod:`order` — the simulator in :mod:`trace` uses the same
functions — and the communication is :class:`p2p.PipeComm`.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext

import torch
from torch.autograd.variable import Variable

from .order import (
    check_interleaved_microbatches,
    interleaved_backward_op,
    interleaved_forward_op,
    warmup_1f1b,
    warmup_interleaved,
)
from .p2p import PipeComm, release_output
from .trace import _Recorder


def get_forward_backward_func(state):
    """No pipelining for one stage; interleaved 1F1B when ``state.vpp_size`` (model chunks per
    rank) is above 1; plain 1F1B otherwise."""
    if state.pp_size == 1:
        return forward_backward_no_pipelining
    if (state.vpp_size or 1) > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


# ---------------------------------------------------------------------------------------------
# One forward / one backward of one micro-batch on one model chunk.


def set_input(chunk, x) -> None:
    """Hand a chunk its input activation, looking through wrappers such as DDP (``.module``)."""
    target = chunk
    while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
        target = target.module
    if hasattr(target, "set_input_tensor"):
        target.set_input_tensor(x)
    elif x is not None:
        raise TypeError(f"pipeline model chunk {type(chunk).__name__} needs a set_input_tensor(x) method")


def backward_from(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Back-propagate ``grad`` from ``output`` into the graph, even if ``output``'s values were freed.

    ``torch.autograd.backward`` would compare ``grad`` with the (released, 1-element) ``output``;
    the autograd engine itself only checks ``grad`` against the shape ``output.grad_fn`` recorded.
    """
    if grad is None:  # the loss on the last stage: d loss / d loss = 1
        grad = torch.ones_like(output)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


class _Run:
    """What every step of one schedule call shares: the user's functions, the reported losses,
    the trace recorder and the gradient-sync switch."""

    def __init__(self, forward_step_func, num_microbatches, grad_scale_func, forward_only, trace, state,
                 no_sync_func, num_chunks):
        self.forward_step_func, self.m = forward_step_func, num_microbatches
        self.grad_scale_func, self.forward_only = grad_scale_func, forward_only
        self.reported: list[dict] = []
        self.rec = _Recorder(trace, state.pp_rank)
        # data-parallel reduction off until the last backward (of each chunk, given a list)
        if isinstance(no_sync_func, (list, tuple)):
            factories = list(no_sync_func)
        else:
            factories = [no_sync_func] + [None] * (num_chunks - 1)
        self.contexts = [f() if f is not None else nullcontext() for f in factories]
        self.per_chunk = isinstance(no_sync_func, (list, tuple))
        for ctx in self.contexts:
            ctx.__enter__()
        self.open = [True] * len(self.contexts)

    def enable_sync(self, index: int) -> None:
        if self.open[index]:
            self.open[index] = False
            self.contexts[index].__exit__(None, None, None)

    def finish(self) -> list[dict]:
        for i in range(len(self.contexts)):
            self.enable_sync(i)
        return self.reported

    def forward(self, chunk_model, chunk, data_iterator, x, microbatch, is_last_stage):
        with self.rec.op("F", microbatch, chunk):
            set_input(chunk_model, x)
            output, loss_func = self.forward_step_func(data_iterator, chunk_model)
            if is_last_stage:
                loss, reported = loss_func(output)
                output = loss / self.m
                self.reported.append(reported)
        return output

    def backward(self, x, y, dy, microbatch, chunk):
        """Backward of one micro-batch; returns the gradient of its input (None on the first stage)."""
        if microbatch == self.m - 1 and (self.per_chunk or chunk == 0):
            # the last backward of this chunk (per-chunk factories) or of this rank (one factory):
            # let its gradient reduction happen
            self.enable_sync(chunk if self.per_chunk else 0)
        with self.rec.op("B", microbatch, chunk):
            if dy is None and self.grad_scale_func is not None:
                y = self.grad_scale_func(y)
            backward_from(y, dy)
        return None if x is None else x.grad


def _iterators(data_iterator, num_chunks):
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != num_chunks:
            raise ValueError(f"got {len(data_iterator)} data iterators for {num_chunks} model chunks; give one per chunk")
        return list(data_iterator)
    if num_chunks > 1:
        raise ValueError("the interleaved schedule needs data_iterator as a list with one iterator per model chunk")
    return [data_iterator]


def _setup(model, data_iterator, num_microbatches):
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be positive, got {num_microbatches}")
    return _iterators(data_iterator, len(model))


# ---------------------------------------------------------------------------------------------
# No pipelining: gradient accumulation over micro-batches.


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches, comm: PipeComm,
                                   forward_only=False, grad_scale_func=None, no_sync_func=None, trace=None):
    """Forward and backward of each micro-batch in turn on one stage; gradients accumulate, and the
    data-parallel reduction is left on only for the last micro-batch. ``comm`` is unused (one stage)."""
    if len(model) != 1:
        raise ValueError(f"without pipeline parallelism the model is one chunk, got {len(model)}")
    [data] = _setup(model, data_iterator, num_microbatches)
    run = _Run(forward_step_func, num_microbatches, grad_scale_func, forward_only, trace, comm.state,
               no_sync_func, 1)
    for i in range(num_microbatches):
        loss = run.forward(model[0], 0, data, None, i, True)
        if not forward_only:
            run.backward(None, loss, None, i, 0)
    return run.finish()


# ---------------------------------------------------------------------------------------------
# 1F1B (PipeDream-Flush): at most p - r micro-batches' activations alive on rank r.


def forward_backward_pipelining_without_interleaving(*, forward_step_func, data_iterator, model, num_microbatches,
                                                     comm: PipeComm, forward_only=False, grad_scale_func=None,
                                                     no_sync_func=None, trace=None):
    """One model chunk per rank; warmup forwards, steady one-forward-one-backward, cooldown backwards."""
    if len(model) != 1:
        raise ValueError(
            f"the non-interleaved pipeline schedule runs one model chunk per rank, got {len(model)}; build "
            "the ParallelState with vpp=<chunks per rank> (--num-layers-per-virtual-pipeline-stage) to interleave"
        )
    [data] = _setup(model, data_iterator, num_microbatches)
    state = comm.state
    run = _Run(forward_step_func, num_microbatches, grad_scale_func, forward_only, trace, state, no_sync_func, 1)
    first, last, m, chunk = state.is_first_stage(), state.is_last_stage(), num_microbatches, model[0]
    warm = m if forward_only else warmup_1f1b(state.pp_size, state.pp_rank, m)
    steady = m - warm
    held: deque = deque()  # (input, output) of micro-batches whose backward is still to come, oldest first

    def outgoing(y):
        return None if last else y  # the last stage's output is the loss: nothing to send

    # Phase 1, warmup: forwards only, so that every later stage has work when it starts.
    for i in range(warm):
        x = comm.recv_forward(recv=not first)
        y = run.forward(chunk, 0, data, x, i, last)
        comm.send_forward(outgoing(y))
        if not forward_only:
            held.append((x, y))
        release_output(outgoing(y))

    # Phase 2, steady state: each step runs the forward of micro-batch warm+i, sends its output
    # while receiving the gradient of the oldest micro-batch in flight (i), runs that backward and
    # sends its input gradient while receiving the next micro-batch's input.
    x = comm.recv_forward(recv=not first) if steady else None
    for i in range(steady):
        y = run.forward(chunk, 0, data, x, warm + i, last)
        dy = comm.send_forward_recv_backward(outgoing(y), recv=not last)
        held.append((x, y))
        release_output(outgoing(y))
        x_old, y_old = held.popleft()
        dx = run.backward(x_old, y_old, dy, i, 0)
        if i == steady - 1:
            comm.send_backward(None if first else dx)
        else:
            x = comm.send_backward_recv_forward(None if first else dx, recv=not first)

    # Phase 3, cooldown: the backwards of the warmup micro-batches, as their gradients arrive.
    if not forward_only:
        for i in range(steady, m):
            dy = comm.recv_backward(recv=not last)
            x_old, y_old = held.popleft()
            dx = run.backward(x_old, y_old, dy, i, 0)
            comm.send_backward(None if first else dx)
    return run.finish()


# ---------------------------------------------------------------------------------------------
# Interleaved 1F1B: v model chunks per rank (virtual stage of chunk c on rank r: c * p + r).


def forward_backward_pipelining_with_interleaving(*, forward_step_func, data_iterator, model, num_microbatches,
                                                  comm: PipeComm, forward_only=False, grad_scale_func=None,
                                                  no_sync_func=None, trace=None):
    """Each rank runs its v chunks in the order of :func:`order.order_interleaved`.

    The k-th forward and k-th backward on every rank are the same (micro-batch, chunk) pair
    (:func:`order.interleaved_forward_op`), so a rank knows without asking whether a neighbour
    sends at a given step: every step makes one combined exchange — send what it produced, receive
    the input of its next forward and the output gradient of its next backward. Received tensors
    are consumed in order (first in, first out); chunk 0 of the first rank reads data instead, the
    last chunk of the last rank computes the loss instead. The phases are :class:`_Interleaved`'s.
    """
    check_interleaved_microbatches(num_microbatches, comm.state.pp_size)
    iters = _setup(model, data_iterator, num_microbatches)
    run = _Run(forward_step_func, num_microbatches, grad_scale_func, forward_only, trace, comm.state,
               no_sync_func, len(model))
    steps = _Interleaved(model, iters, comm, run)
    steps.warmup()
    steps.steady()
    if not forward_only:
        steps.cooldown()
    return run.finish()


class _Interleaved:
    """One rank's interleaved schedule: forward step s and backward step b (0 .. m*v - 1) map to a
    (micro-batch, chunk) pair, and the three phases run them with their exchanges."""

    def __init__(self, model, iters, comm: PipeComm, run: _Run):
        state = comm.state
        self.model, self.iters, self.comm, self.run = model, iters, comm, run
        self.p, self.v, m = state.pp_size, len(model), run.m
        self.first, self.last = state.is_first_stage(), state.is_last_stage()
        self.total = m * self.v
        self.all_warmup = run.forward_only or m == self.p
        self.warm = self.total if run.forward_only else warmup_interleaved(self.p, state.pp_rank, m, self.v)
        self.act_in: deque = deque()   # received inputs, in forward order
        self.grad_in: deque = deque()  # received output gradients, in backward order
        self.held = [deque() for _ in range(self.v)]  # per chunk: (input, output) awaiting backward

    def fwd(self, s):
        return interleaved_forward_op(s, self.p, self.v)

    def bwd(self, b):
        return interleaved_backward_op(b, self.p, self.v)

    def act_coming(self, s):  # does the previous rank send the input of my forward s + 1?
        return s + 1 < self.total and not (self.first and self.fwd(s + 1)[1] == 0)

    def grad_coming(self, b):  # does the next rank send the output gradient of my backward b + 1?
        return (not self.run.forward_only and b + 1 < self.total
                and not (self.last and self.bwd(b + 1)[1] == self.v - 1))

    @staticmethod
    def push(queue, t):
        if t is not None:
            queue.append(t)

    def forward(self, s):
        mb, c = self.fwd(s)
        x = None if (self.first and c == 0) else self.act_in.popleft()
        is_loss = self.last and c == self.v - 1
        y = self.run.forward(self.model[c], c, self.iters[c], x, mb, is_loss)
        if not self.run.forward_only:
            self.held[c].append((x, y))
        return None if is_loss else y  # what goes to the next virtual stage

    def backward(self, b):
        mb, c = self.bwd(b)
        x, y = self.held[c].popleft()
        dy = None if (self.last and c == self.v - 1) else self.grad_in.popleft()
        dx = self.run.backward(x, y, dy, mb, c)
        return None if (self.first and c == 0) else dx

    def warmup(self):
        """Forwards only. Each step sends its output on and receives the next forward's input;
        the last warmup step also receives the gradient the first backward will need."""
        comm = self.comm
        self.push(self.act_in, comm.recv_forward(recv=not self.first))
        for s in range(self.warm):
            out = self.forward(s)
            if s == self.warm - 1 and not self.all_warmup:
                x_next, dy = comm.send_forward_backward_recv_forward_backward(
                    out, None, recv_prev=self.act_coming(s), recv_next=self.grad_coming(-1))
                self.push(self.grad_in, dy)
            else:
                x_next = comm.send_forward_recv_forward(out, recv_prev=self.act_coming(s))
            self.push(self.act_in, x_next)
            release_output(out)

    def steady(self):
        """Forward s = warm + k and backward k, then one exchange in both directions."""
        for k in range(self.total - self.warm):
            s = self.warm + k
            out = self.forward(s)
            dx = self.backward(k)
            x_next, dy = self.comm.send_forward_backward_recv_forward_backward(
                out, dx, recv_prev=self.act_coming(s), recv_next=self.grad_coming(k))
            release_output(out)
            self.push(self.act_in, x_next)
            self.push(self.grad_in, dy)

    def cooldown(self):
        """The remaining backwards, each receiving the gradient for the next one."""
        if self.all_warmup:
            self.push(self.grad_in, self.comm.recv_backward(recv=self.grad_coming(-1)))
        for b in range(self.total - self.warm, self.total):
            dx = self.backward(b)
            self.push(self.grad_in, self.comm.send_backward_recv_backward(dx, recv_next=self.grad_coming(b)))
