"""Forward/backward schedules over micro-batches: no pipelining, 1F1B, interleaved 1F1B, ZB-H1,
interleaved zero bubble.

``get_forward_backward_func(state, schedule)`` picks one; all share one keyword-only signature
``(forward_step_func, data_iterator, model, num_microbatches, comm, forward_only=False,
grad_scale_func=None, no_sync_func=None, trace=None)``:

- ``forward_step_func(data_iterator, model_chunk) -> (output_tensor, loss_func)``; a chunk gets its
  input from the previous stage through ``set_input_tensor`` before the call (None on the first stage).
- On the last stage ``loss_func(output_tensor) -> (loss, reported)``; the schedule divides ``loss`` by
  ``num_microbatches``, applies ``grad_scale_func`` before backward, and returns the ``reported``
  dicts (last stage only; ``[]`` elsewhere). A ``loss_func`` may instead return ``(loss, num_tokens,
  reported)`` (``--calculate-per-token-loss``): ``loss`` is then a sum over tokens, backpropagated
  undivided, and the returned list's ``num_tokens`` adds up the counts (the caller divides the
  gradients by the global count: :mod:`megatron_lite.training.per_token_loss`).
- ``no_sync_func()`` (or a list, one per chunk) is a context-manager factory that suppresses
  data-parallel gradient reduction; it stays entered until the last backward (of that chunk).
- ``comm`` is the run's :class:`p2p.PipeComm` (activation shape and dtype, built once per run); its
  ``comm.state`` is the ParallelState the schedule follows. The no-pipelining schedule sends nothing
  but takes it too, so the three are interchangeable.
- ``forward_only=True`` runs forwards only (evaluation); ``trace`` (a list) receives one
  :class:`trace.Event` per forward/backward (and, zero-bubble, per weight-gradient pass), in
  execution order.

The op order of each rank comes from :mod:`order` — the simulator in :mod:`trace` uses the same
functions — and the communication is :class:`p2p.PipeComm`.
"""

from __future__ import annotations

from collections import deque

import torch

from .microbatch import _Run, _setup, backward_from, set_input
from .order import (
    SCHEDULES,
    check_interleaved_microbatches,
    interleaved_backward_op,
    interleaved_forward_op,
    order_zb_interleaved,
    warmup_1f1b,
    warmup_interleaved,
    zb_h1_deferred,
)
from .p2p import PipeComm, release_output
from .wgrad import WeightGradStore

__all__ = [
    "backward_from", "forward_backward_no_pipelining", "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving", "forward_backward_pipelining_zero_bubble",
    "forward_backward_pipelining_zero_bubble_interleaved", "get_forward_backward_func", "set_input",
]


def get_forward_backward_func(state, schedule: str = "1f1b"):
    """No pipelining for one stage; interleaved 1F1B when ``state.vpp_size`` (model chunks per
    rank) is above 1; plain 1F1B otherwise. With ``schedule="zb-h1"``: ZB-H1 (one chunk per rank) or
    interleaved zero bubble (several)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if state.pp_size == 1:
        return forward_backward_no_pipelining
    if (state.vpp_size or 1) > 1:
        if schedule == "zb-h1":
            return forward_backward_pipelining_zero_bubble_interleaved
        return forward_backward_pipelining_with_interleaving
    if schedule == "zb-h1":
        return forward_backward_pipelining_zero_bubble
    return forward_backward_pipelining_without_interleaving


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
    run = _Run(forward_step_func, num_microbatches, grad_scale_func, forward_only, trace, comm.state, no_sync_func, 1)
    _one_f_one_b(run, model, data_iterator, comm)
    return run.finish()


def forward_backward_pipelining_zero_bubble(*, forward_step_func, data_iterator, model, num_microbatches,
                                            comm: PipeComm, forward_only=False, grad_scale_func=None,
                                            no_sync_func=None, trace=None):
    """ZB-H1 (:func:`order.order_zb_h1`): 1F1B's forwards, sends and receives, with each backward
    split into B (input gradient, sent on at once) and a deferred W (weight gradients, see
    :mod:`wgrad`). Rank r keeps r W passes pending and runs them in the cooldown, where 1F1B waits;
    at most p micro-batches are in flight on any rank, as on 1F1B's first rank.
    """
    run = _Run(forward_step_func, num_microbatches, grad_scale_func, forward_only, trace, comm.state, no_sync_func, 1)
    if forward_only:  # nothing to split
        _one_f_one_b(run, model, data_iterator, comm)
        return run.finish()
    run.store = WeightGradStore()
    with run.store.installed(model[0]):
        _one_f_one_b(run, model, data_iterator, comm, keep=zb_h1_deferred(comm.state.pp_size, comm.state.pp_rank))
        run.weight_pass(0)  # the W passes rank r held back
    return run.finish()


def _one_f_one_b(run: _Run, model, data_iterator, comm: PipeComm, keep: int = 0) -> None:
    """The 1F1B phases. With ``run.store`` (zero bubble) each B is followed, once its input gradient
    is on its way, by the W passes beyond the ``keep`` this rank holds back."""
    if len(model) != 1:
        raise ValueError(
            f"the non-interleaved pipeline schedule runs one model chunk per rank, got {len(model)}; build "
            "the ParallelState with vpp=<chunks per rank> (--num-layers-per-virtual-pipeline-stage) to interleave"
        )
    [data] = _setup(model, data_iterator, run.m)
    state, forward_only = comm.state, run.forward_only
    first, last, m, chunk = state.is_first_stage(), state.is_last_stage(), run.m, model[0]
    warm = m if forward_only else warmup_1f1b(state.pp_size, state.pp_rank, m)
    steady = m - warm
    held: deque = deque()  # (input, output) of micro-batches whose backward is still to come, oldest first

    def outgoing(y):
        return None if last else y  # the last stage's output is the loss: nothing to send

    def weights():
        if run.store is not None:
            run.weight_pass(keep)

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
            weights()
        elif run.store is None:
            x = comm.send_backward_recv_forward(None if first else dx, recv=not first)
        else:  # zero bubble: the W passes run while the next input is on its way
            next_input = comm.start_send_backward_recv_forward(None if first else dx, recv=not first)
            weights()
            x = next_input()

    # Phase 3, cooldown: the backwards of the warmup micro-batches, as their gradients arrive.
    if not forward_only:
        for i in range(steady, m):
            dy = comm.recv_backward(recv=not last)
            x_old, y_old = held.popleft()
            dx = run.backward(x_old, y_old, dy, i, 0)
            comm.send_backward(None if first else dx)
            weights()


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


def forward_backward_pipelining_zero_bubble_interleaved(*, forward_step_func, data_iterator, model,
                                                        num_microbatches, comm: PipeComm, forward_only=False,
                                                        grad_scale_func=None, no_sync_func=None, trace=None):
    """Interleaved zero bubble (:func:`order.order_zb_interleaved`): interleaved 1F1B's forwards,
    backwards, sends and receives, each backward split into B (input gradient, sent on at once) and
    a W (weight gradients, :mod:`wgrad`) run where the order puts it: while the step's exchange is in
    flight (the bubbles of warmup and cooldown), and never so late that a rank holds more
    micro-batch-chunks in flight than interleaved 1F1B's first rank.
    """
    if forward_only:  # nothing to split
        return forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, comm=comm, forward_only=True, grad_scale_func=grad_scale_func,
            no_sync_func=no_sync_func, trace=trace)
    state = comm.state
    check_interleaved_microbatches(num_microbatches, state.pp_size)
    iters = _setup(model, data_iterator, num_microbatches)
    run = _Run(forward_step_func, num_microbatches, grad_scale_func, False, trace, state, no_sync_func, len(model))
    run.store = WeightGradStore()
    steps = _Interleaved(model, iters, comm, run)
    steps.plan_weights(order_zb_interleaved(state.pp_size, state.pp_rank, num_microbatches, len(model)))
    with run.store.installed(torch.nn.ModuleList(model)):
        steps.warmup()
        steps.steady()
        steps.cooldown()
        steps.weights()  # the W passes after the last B
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
        self.done = 0  # F and B ops run so far
        self.w_due: dict[int, list] = {}  # zero bubble: F/B ops done -> the W ops (mb, chunk) that follow them

    def plan_weights(self, order) -> None:
        """Zero bubble: run the W ops of ``order`` (this rank's op order) where it puts them."""
        count = 0
        for kind, mb, chunk in order:
            if kind == "W":
                self.w_due.setdefault(count, []).append((mb, chunk))
            else:
                count += 1

    def weights(self) -> None:
        """The W passes due after the F/B ops run so far (none without zero bubble)."""
        for mb, chunk in self.w_due.pop(self.done, ()):
            self.run.weight_op(mb, chunk)

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """One batch of sends and receives; the W passes due now run while it is in flight."""
        finish = self.comm.communicate(send_next, send_prev, recv_prev, recv_next, wait=False)
        self.weights()
        return finish()

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
        self.weights()
        self.done += 1
        mb, c = self.fwd(s)
        x = None if (self.first and c == 0) else self.act_in.popleft()
        is_loss = self.last and c == self.v - 1
        y = self.run.forward(self.model[c], c, self.iters[c], x, mb, is_loss)
        if not self.run.forward_only:
            self.held[c].append((x, y))
        return None if is_loss else y  # what goes to the next virtual stage

    def backward(self, b):
        self.weights()
        self.done += 1
        mb, c = self.bwd(b)
        x, y = self.held[c].popleft()
        dy = None if (self.last and c == self.v - 1) else self.grad_in.popleft()
        dx = self.run.backward(x, y, dy, mb, c)
        return None if (self.first and c == 0) else dx

    def warmup(self):
        """Forwards only. Each step sends its output on and receives the next forward's input;
        the last warmup step also receives the gradient the first backward will need."""
        self.push(self.act_in, self.exchange(recv_prev=not self.first)[0])
        for s in range(self.warm):
            out = self.forward(s)
            if s == self.warm - 1 and not self.all_warmup:
                x_next, dy = self.exchange(out, None, recv_prev=self.act_coming(s), recv_next=self.grad_coming(-1))
                self.push(self.grad_in, dy)
            else:
                x_next = self.exchange(out, recv_prev=self.act_coming(s))[0]
            self.push(self.act_in, x_next)
            release_output(out)

    def steady(self):
        """Forward s = warm + k and backward k, then one exchange in both directions."""
        for k in range(self.total - self.warm):
            s = self.warm + k
            out = self.forward(s)
            dx = self.backward(k)
            x_next, dy = self.exchange(out, dx, recv_prev=self.act_coming(s), recv_next=self.grad_coming(k))
            release_output(out)
            self.push(self.act_in, x_next)
            self.push(self.grad_in, dy)

    def cooldown(self):
        """The remaining backwards, each receiving the gradient for the next one."""
        if self.all_warmup:
            self.push(self.grad_in, self.exchange(recv_next=self.grad_coming(-1))[1])
        for b in range(self.total - self.warm, self.total):
            dx = self.backward(b)
            self.push(self.grad_in, self.exchange(send_prev=dx, recv_next=self.grad_coming(b))[1])
