"""Fused bias + dropout + residual add (``--bias-dropout-fusion``, on by default).

The attention output projection and fc2 leave their bias out (``skip_bias_add``) and the layer
computes ``residual + dropout(x + bias)`` in one ``jit_fuser`` function: one kernel when compiled,
instead of a bias add, a dropout and a residual add. Eager, it is the same three operations in the
same order as the unfused layer, so the two give identical results. Dropout (:func:`~.dropout.dropout`)
draws from the default generator (or the tensor-parallel one the caller forks into under sequence parallelism).
"""

from __future__ import annotations

import torch

from .dropout import dropout
from .jit import jit_fuser


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


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float,
                     training: bool) -> torch.Tensor:
    """``residual + dropout(x + bias, prob)`` (no dropout when not ``training`` or ``prob`` is 0)."""
    if training and prob > 0:
        return _bias_dropout_add_train(x, bias, residual, prob)
    return _bias_add_residual(x, bias, residual)
