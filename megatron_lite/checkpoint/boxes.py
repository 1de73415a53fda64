"""Boxes: the geometry behind the sharded (``torch_dist``) checkpoint format.

Every saved tensor is a *box* (an offset and a shape) inside the *canonical* form of one global
tensor. The canonical form makes each tensor-parallel shard a rectangle: a parameter split over
TP along ``dim`` with stride ``s`` (``s`` blocks, each chunked over the ranks: SwiGLU's ``[gate;
up]`` fc1) is viewed with ``dim`` replaced by ``(s, n / s)``; rank ``t`` then holds the slab
``[t * n/(s*tp), (t+1) * n/(s*tp))`` of the second of those axes, at every TP size. Replicated
tensors are their own canonical form. The full tensor is the canonical one with the two axes
merged again, because the stride blocks are contiguous along ``dim``.

The distributed optimizer owns a flat range ``[lo, hi)`` of a shard; :func:`flat_boxes` cuts such
a range into boxes (at most ``2 * ndim - 1``), each a contiguous run of the range.
"""

from __future__ import annotations

import math

import torch


def canonical_shape(shape, dim: int | None, stride: int = 1) -> tuple[int, ...]:
    """``shape`` with ``dim`` split into ``(stride, shape[dim] / stride)``; unchanged when ``dim`` is None."""
    shape = tuple(int(x) for x in shape)
    if dim is None:
        return shape
    return shape[:dim] + (stride, shape[dim] // stride) + shape[dim + 1:]


def full_shape(canonical, dim: int | None) -> tuple[int, ...]:
    """Inverse of :func:`canonical_shape`: merge the stride axis back into ``dim``."""
    canonical = tuple(canonical)
    if dim is None:
        return canonical
    return canonical[:dim] + (canonical[dim] * canonical[dim + 1],) + canonical[dim + 2:]


def shard_offset(local_canonical, dim: int | None, tp_rank: int) -> tuple[int, ...]:
    """Global canonical offset of TP rank ``tp_rank``'s shard (its local canonical shape given)."""
    offset = [0] * len(local_canonical)
    if dim is not None:
        offset[dim + 1] = tp_rank * local_canonical[dim + 1]
    return tuple(offset)


def flat_boxes(shape, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range ``[lo, hi)`` of a C-ordered tensor of ``shape`` as boxes:
    ``[(offset, sizes, start)]`` where ``start`` is where the box's elements begin in the range."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((lo,), (hi - lo,), 0)]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner

    def row(r, a, b, start):  # part [a, b) of row r
        return [((r,) + off, (1,) + size, start + s) for off, size, s in flat_boxes(shape[1:], a, b)]

    if first == last:
        return row(first, lo - first * inner, hi - first * inner, 0)
    out, start, r = [], 0, first
    if lo % inner:
        out += row(first, lo % inner, inner, 0)
        start, r = inner - lo % inner, first + 1
    full_end = last if hi % inner else last + 1
    if full_end > r:
        out.append(((r,) + (0,) * (len(shape) - 1), (full_end - r,) + shape[1:], start))
        start += (full_end - r) * inner
    if hi % inner:
        out += row(last, 0, hi % inner, start)
    return out


def intersect(off_a, size_a, off_b, size_b):
    """The overlap of two boxes as ``(offset, sizes)``, or None."""
    lo = [max(a, b) for a, b in zip(off_a, off_b)]
    hi = [min(a + sa, b + sb) for a, sa, b, sb in zip(off_a, size_a, off_b, size_b)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


def region(tensor: torch.Tensor, tensor_offset, box_offset, box_size) -> torch.Tensor:
    """The view of ``tensor`` (placed at ``tensor_offset``) covering the box."""
    index = tuple(slice(o - t, o - t + s) for o, t, s in zip(box_offset, tensor_offset, box_size))
    return tensor[index]


def extent(boxes) -> tuple[int, ...]:
    """The smallest shape holding every ``(offset, size)`` box."""
    boxes = list(boxes)
    return tuple(max(o[i] + s[i] for o, s in boxes) for i in range(len(boxes[0][0])))
