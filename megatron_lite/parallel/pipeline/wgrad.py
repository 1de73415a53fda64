"""Splitting a backward pass into B (input gradient) and W (weight gradients) for zero-bubble pipelining.

What is deferred, exactly: the weight gradient (and, for a GEMM that adds its bias itself, the bias
gradient) of every :class:`~megatron_lite.parallel.tensor.ColumnParallelLinear` and
:class:`~megatron_lite.parallel.tensor.RowParallelLinear` whose GEMM is the default
:func:`~megatron_lite.parallel.tensor.linear_gemm` and whose weight is a leaf parameter. These are the QKV,
attention-output, both MLP projections and the output layer: nearly all the weight-gradient FLOPs
of a transformer (under ``--torch-compile`` they run eagerly between the compiled pieces of a
layer, so that their backward can still defer). Everything else computes its weight gradients
during B, as autograd always does: norms, embeddings, the row-parallel bias (added after the
reduction), MLA's replicated down projections, the MoE router and experts, layers whose GEMM is a
precision recipe's (it owns its backward) and weights that are not leaves.

How: :meth:`WeightGradStore.installed` swaps those layers' ``gemm`` for :meth:`WeightGradStore.gemm`
(the seam the layers already have), an autograd function whose backward returns only the input
gradient and stashes ``(input, output gradient)`` (a layer with gradient-accumulation fusion too: its W then goes through
autograd like the others); the stashed tensors are what ``dW = dY^T X``
needs, so they stay alive until W runs. A W pass (:meth:`WeightGradStore.flush`) computes the
stashed products of one micro-batch and hands them to autograd on the parameters themselves
(``torch.autograd.backward(weight, dW)``), so gradient accumulation and every gradient hook (the
data-parallel buffer, bucket readiness) behave as if the gradient came from the ordinary backward.
(During B autograd still calls a deferred weight's post-accumulate hook, with ``weight.grad`` None;
the data-parallel hook ignores such calls, so a weight is marked ready only by its W. With sharded
gradients, ZeRO-2/3, for a weight of :func:`deferred_params` such a call means "no gradient of it in
this pass": its bucket does not wait for it, and the W pass, a backward of its own, reduce-scatters
what it computed at its end.)

Without :meth:`WeightGradStore.collect` active, the function computes the weight gradients at once
(nothing is deferred): forward-only passes and any backward outside the schedule stay correct.

A layer of another kind can defer its own weight gradients: give it a method
``set_weight_grad_store(store)`` (called with the store when the schedule installs it, with None
after) and, in its backward while ``store.collecting``, call ``store.defer(fn)`` with a function
returning ``[(parameter, gradient), ...]``; W calls it.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import torch

from ..tensor import DEFAULT_GEMMS, ColumnParallelLinear, RowParallelLinear, linear_gemm


class _DeferrableLinear(torch.autograd.Function):
    """``x @ weight^T + bias`` whose weight/bias gradients go to ``store`` while it collects."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.bias = store, bias
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        want_w, want_b = ctx.needs_input_grad[1], ctx.bias is not None and ctx.needs_input_grad[2]
        if not (want_w or want_b):
            return dx, None, None, None
        if ctx.store.collecting:
            bias = ctx.bias if want_b else None
            ctx.store.defer(lambda: list(zip((weight, bias), weight_grads(x, dy, want_w, want_b))))
            return dx, None, None, None
        dw, db = weight_grads(x, dy, want_w, want_b)
        return dx, dw, db, None


_apply_eagerly = torch._disable_dynamo(lambda x, weight, bias, store: _DeferrableLinear.apply(x, weight, bias, store))


def weight_grads(x, dy, want_w: bool, want_b: bool):
    """``(dW, db)`` of ``y = x W^T + b``: ``dW = dY^T X`` and ``db = sum(dY)`` over all tokens."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw = dy2.t().matmul(x.reshape(-1, x.shape[-1])) if want_w else None
    db = dy2.sum(0) if want_b else None
    return dw, db


class WeightGradStore:
    """The deferred weight-gradient work of one rank: one list of GEMMs per micro-batch, oldest first.

    The schedule wraps each B in :meth:`collect` (what it stashes becomes one W entry) and later
    calls :meth:`flush` once per micro-batch in the same order.
    """

    def __init__(self):
        self.collecting = False
        self._current: list | None = None
        self._pending: deque[list] = deque()

    def gemm(self, x, weight, bias=None):
        """Drop-in for ``linear_gemm``: same result, deferrable weight gradient (leaf parameters only:
        a computed weight's graph would be gone by the time W runs). Inside a compiled layer
        (``--torch-compile``) it runs eagerly, a graph break: traced, its backward's choice between
        deferring and computing at once was fixed when the graph was built (compute at once), so
        ZB-H1 deferred nothing."""
        if weight.grad_fn is not None or (bias is not None and bias.grad_fn is not None):
            return linear_gemm(x, weight, bias)
        if torch.compiler.is_compiling():
            return _apply_eagerly(x, weight, bias, self)
        return _DeferrableLinear.apply(x, weight, bias, self)

    def defer(self, fn) -> None:
        """Add ``fn() -> [(parameter, gradient or None), ...]`` to the W entry being collected; what
        ``fn`` refers to (the GEMM input and output gradient) stays alive until the W runs."""
        self._current.append(fn)

    @contextmanager
    def collect(self):
        """During the block, deferrable weight gradients are stashed as one new W entry."""
        self.collecting, self._current = True, []
        try:
            yield
        finally:
            self._pending.append(self._current)
            self.collecting, self._current = False, None

    @property
    def num_pending(self) -> int:
        """W entries stashed and not yet run."""
        return len(self._pending)

    def flush(self) -> None:
        """Run the oldest W entry: compute its weight gradients and accumulate them through autograd."""
        grads: dict[int, list] = {}  # id(param) -> [param, summed gradient]
        for fn in self._pending.popleft():
            for t, g in fn():
                if t is None or g is None:
                    continue
                if id(t) in grads:  # one weight in several GEMMs (tied embedding and output layer)
                    grads[id(t)][1] = grads[id(t)][1] + g
                else:
                    grads[id(t)] = [t, g]
        if grads:
            params, values = zip(*grads.values())
            torch.autograd.backward(list(params), list(values))

    @contextmanager
    def installed(self, module: torch.nn.Module):
        """Route the deferrable parallel linear layers of ``module`` through :meth:`gemm` for the block."""
        swapped = [(m, m.gemm) for m in _deferrable_layers(module)]
        own = [m for m in module.modules() if hasattr(m, "set_weight_grad_store")]
        for m, _ in swapped:
            m.gemm = self.gemm
        for m in own:
            m.set_weight_grad_store(self)
        try:
            yield
            if self._pending:
                raise RuntimeError(f"{len(self._pending)} deferred weight-gradient passes never ran")
        finally:
            for m, gemm in swapped:
                m.gemm = gemm
            for m in own:
                m.set_weight_grad_store(None)
            self._pending.clear()


def _deferrable_layers(module: torch.nn.Module) -> list:
    return [m for m in module.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.gemm in DEFAULT_GEMMS]


def deferred_params(module: torch.nn.Module) -> frozenset[int]:
    """Ids of the parameters of ``module`` whose gradients :meth:`WeightGradStore.installed` defers to W:
    the weights of its deferrable layers and the biases their GEMMs add (column-parallel, not
    ``skip_bias_add``). The sharded data-parallel wrappers bucket them apart (one reduce-scatter per
    pass) and, in B, do not wait for their gradients (ZeRO-3 frees each unit after its B). A weight
    read through another layer (a tied output layer) or deferred by a layer's own
    ``set_weight_grad_store`` is not listed: still correct, but its bucket is reduced by both passes
    and, under ZeRO-3, its unit stays gathered until the end of B."""
    ids = set()
    for m in _deferrable_layers(module):
        adds_bias = isinstance(m, ColumnParallelLinear) and not m.skip_bias_add
        ids.update(id(p) for p in (m.weight, m.bias if adds_bias else None) if p is not None)
    return frozenset(ids)
