"""One forward and one backward of one micro-batch on one model chunk, shared by every schedule.

:class:`_Run` holds what all steps of one schedule call share: the user's step function, the
reported losses, the trace recorder, the data-parallel sync switch and, for the zero-bubble
schedule, the store of deferred weight-gradient passes (:mod:`wgrad`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.autograd.variable import Variable

from .trace import _Recorder
from .wgrad import WeightGradStore


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


class Reported(list):
    """What a schedule returns: the last stage's ``reported`` dicts, one per micro-batch, and
    ``num_tokens``: the loss tokens those micro-batches counted when their ``loss_func`` returned
    ``(loss, num_tokens, reported)`` (``--calculate-per-token-loss``; 0 otherwise and off the last stage)."""

    num_tokens = 0


class _Run:
    """What every step of one schedule call shares: the user's functions, the reported losses,
    the trace recorder and the gradient-sync switch."""

    def __init__(self, forward_step_func, num_microbatches, grad_scale_func, forward_only, trace, state,
                 no_sync_func, num_chunks):
        self.forward_step_func, self.m = forward_step_func, num_microbatches
        self.grad_scale_func, self.forward_only = grad_scale_func, forward_only
        self.reported = Reported()
        self.rec = _Recorder(trace, state.pp_rank)
        self.store: WeightGradStore | None = None  # set by the zero-bubble schedule
        self.w_done = 0
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

    def finish(self) -> Reported:
        for i in range(len(self.contexts)):
            self.enable_sync(i)
        return self.reported

    def forward(self, chunk_model, chunk, data_iterator, x, microbatch, is_last_stage):
        with self.rec.op("F", microbatch, chunk):
            set_input(chunk_model, x)
            output, loss_func = self.forward_step_func(data_iterator, chunk_model)
            if is_last_stage:
                outputs = loss_func(output)
                if len(outputs) == 3:  # (token-loss sum, its token count, reported): the step divides later
                    output, num_tokens, reported = outputs
                    self.reported.num_tokens = self.reported.num_tokens + num_tokens
                else:
                    loss, reported = outputs
                    output = loss / self.m
                self.reported.append(reported)
        return output

    def backward(self, x, y, dy, microbatch, chunk):
        """Backward of one micro-batch; returns the gradient of its input (None on the first stage)."""
        if microbatch == self.m - 1 and (self.per_chunk or chunk == 0) and self.store is None:
            # the last backward of this chunk (per-chunk factories) or of this rank (one factory):
            # let its gradient reduction happen
            self.enable_sync(chunk if self.per_chunk else 0)
        with self.rec.op("B", microbatch, chunk), (self.store.collect() if self.store is not None else nullcontext()):
            if dy is None and self.grad_scale_func is not None:
                y = self.grad_scale_func(y)
            backward_from(y, dy)
        return None if x is None else x.grad

    def weight_pass(self, keep: int) -> None:
        """Zero-bubble W passes: run the oldest deferred weight gradients while more than ``keep`` wait.

        W passes run in micro-batch order, so the one of the last micro-batch is the last op that
        produces gradients: the data-parallel reduction is switched on just before it (gradients of
        the parameters not deferred arrived earlier, unsynced; their buckets are reduced when the
        grads are finalised).
        """
        while self.store.num_pending > keep:
            self.weight_op(self.w_done, 0)
            self.w_done += 1

    def weight_op(self, microbatch: int, chunk: int) -> None:
        """One W pass: the oldest deferred weight gradients, those of ``microbatch`` on ``chunk``. The
        last micro-batch's W of a chunk (per-chunk sync factories) or of chunk 0 (one factory) switches
        that data-parallel reduction on first: nothing of that chunk (of the rank) produces gradients after it."""
        if microbatch == self.m - 1 and (self.per_chunk or chunk == 0):
            self.enable_sync(chunk if self.per_chunk else 0)
        with self.rec.op("W", microbatch, chunk):
            self.store.flush()


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
