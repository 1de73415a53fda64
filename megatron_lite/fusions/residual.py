"""Fused bias + dropout + residual add (``--bias-dropout-fusion``, on by default).

The attention output projection and fc2 leave their bias out (``skip_bias_add``) and the layer
computes ``residual + dropout(x + bias)`` in one ``jit_fuser`` function: one kernel when compiled,
instead of a bias add, a dropout and a residual add. Eager, it is the same three operations as the
unfused layer, so the two give identical results; the residual is added in place into the new tensor
the bias add (or dropout) made (from ``IN_PLACE_FROM`` entries), which saves one allocation of the
activation's size. Dropout (:func:`~.dropout.dropout`)
draws from the default generator (or the tensor-parallel one the caller forks into under sequence parallelism).
"""

from __future__ import annotations

import torch

from .dropout import dropout
from .jit import jit_fuser

IN_PLACE_FROM = 1 << 16  # entries: from here the eager form adds the residual in place


@jit_fuser
def _bias_dropout_add_train(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                            prob: float) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    return residual + dropout(x, prob)


@jit_fuser
def _bias_add_residual(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    return residual + x


def _eager_bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float,
                            drop: bool) -> torch.Tensor:
    """The eager form: the residual is added in place into the new tensor ``x + bias`` (or dropout's
    output) when that has the residual's dtype and shape and ``IN_PLACE_FROM`` entries or more (an
    in-place add costs autograd a little more than the allocation it saves on a small tensor); neither
    ``add`` nor dropout saves its output for backward, and ``a + b`` is ``b + a`` to the bit."""
    out = x if bias is None else x + bias
    if drop:
        out = dropout(out, prob)
    if out is x or out.numel() < IN_PLACE_FROM or out.dtype != residual.dtype or out.shape != residual.shape:
        return residual + out
    return out.add_(residual)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float,
                     training: bool) -> torch.Tensor:
    """``residual + dropout(x + bias, prob)`` (no dropout when not ``training`` or ``prob`` is 0)."""
    drop = training and prob > 0
    fused = _bias_dropout_add_train if drop else _bias_add_residual
    args = (x, bias, residual, prob) if drop else (x, bias, residual)
    if fused.compiles_for(*args):
        return fused(*args)
    return _eager_bias_dropout_add(x, bias, residual, prob, drop)
