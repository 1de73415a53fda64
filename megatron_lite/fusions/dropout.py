"""Dropout that keeps a boolean mask on the CPU.

On the CPU, ``F.dropout`` draws with the Bernoulli kernel (about 3x slower per element than a
uniform draw on a 2-core AMD EPYC) and keeps its mask for backward in the activation's dtype.
:func:`dropout` draws ``uniform >= p`` instead and keeps the boolean (1 byte per element, as
Korthikanti et al. count it): the same distribution, another random stream. On other devices it
is ``F.dropout`` (one fused kernel there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)``; on the CPU with a boolean keep mask drawn as ``uniform >= p``."""
    if not training or p == 0:
        return x
    if x.device.type != "cpu" or p >= 1:
        return F.dropout(x, p, True)
    keep = torch.rand(x.shape, device=x.device) >= p
    return x.mul(keep).mul_(1.0 / (1.0 - p))
