"""Dropout that keeps a one-byte mask on the CPU, drawn from 64-bit random words.

On the CPU, ``F.dropout`` draws with the Bernoulli kernel (about 3x slower per element than a
uniform draw on a 2-core AMD EPYC) and keeps its mask for backward in the activation's dtype.
:func:`dropout` keeps a one-byte mask instead (as Korthikanti et al. count it), drawn by
:func:`keep_mask`: PyTorch's CPU random kernels are serial and pay per generator call, so the mask
is drawn as full-range 64-bit integers, each read as four 16-bit lanes (two 32-bit lanes when
``p < 1/128``) compared with a threshold straight into a ``uint8`` 0/1 tensor, about 4x faster than
``rand(...) < p``. An entry is dropped with probability ``round(p * 2^16) / 2^16`` (with 32-bit lanes
``round(p * 2^32) / 2^32``): p to within 2^-17, at most 0.1% of p. The output is
``x * keep / (1 - p)``; multiplying by the 0/1 bytes is one vectorised pass (``torch.where`` on a
boolean mask is an element-by-element loop on the CPU, 2-3x slower), and its backward keeps only the
mask. On other devices it is ``F.dropout`` (one fused kernel there). Either way the mask follows
from the current generator's state: set the seed (or restore the state) and the same mask is drawn
again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SHORT_LANES_MIN_P = 1 / 128  # from here up 16-bit lanes hold p to within 0.1% of itself


def lane_bits(p: float) -> int:
    """Bits of random integer per mask entry that :func:`keep_mask` draws for probability ``p``."""
    return 16 if p >= SHORT_LANES_MIN_P else 32


@torch.compiler.disable  # Dynamo cannot trace random_; in a compiled region this is one clean break
def keep_mask(shape, p: float) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``shape``: 0 (dropped) with probability ``p``, else 1, from the CPU
    generator (lanes of 64-bit draws, module docstring)."""
    bits = lane_bits(p)
    lanes = 2**bits
    threshold = round(p * lanes) - lanes // 2  # a lane is uniform over [-lanes / 2, lanes / 2)
    keep = torch.empty(shape, dtype=torch.uint8)
    if threshold >= lanes // 2:
        return keep.zero_()
    n = math.prod(shape)
    per_word = 64 // bits
    words = torch.empty(-(-n // per_word), dtype=torch.int64).random_(-(2**63), None)  # all 64 bits random
    lane = words.view(torch.int16 if bits == 16 else torch.int32)[:n].view(shape)
    return torch.ge(lane, threshold, out=keep)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)``; on the CPU with a one-byte :func:`keep_mask`."""
    if not training or p == 0:
        return x
    if x.device.type != "cpu" or p >= 1:
        return F.dropout(x, p, True)
    return torch.mul(x, keep_mask(x.shape, p)).mul_(1.0 / (1.0 - p))  # backward saves the mask only
