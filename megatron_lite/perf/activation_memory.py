"""Activation memory: what a forward pass keeps for backward, measured, beside Korthikanti et al.'s formulas.

:func:`saved_activation_bytes` runs a module under the live-tensor tracker
(:class:`~megatron_lite.perf.memory_tracker.MemoryTracker`) and returns the bytes it counts as
activations when the forward pass returns: every tensor autograd saved for backward and still
alive, once per storage (a linear layer saving a reshaped view of a tensor another op also saved
costs nothing more), the module's parameters excluded (weights are model state, not activations).

:func:`korthikanti_layer_bytes` is the per-transformer-layer estimate of Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models") for 16-bit activations and
1-byte dropout masks (s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size):
``sbh (34 + 5 a s / h)`` without parallelism, ``sbh (10 + 24/t + 5 a s / (h t))`` with TP,
``sbh/t (34 + 5 a s / h)`` with TP + sequence parallelism, ``34 sbh / t`` with selective
recomputation (core attention recomputed), ``2 sbh`` with full recomputation (the layer input
only). The 34 sbh break down as: the two norms' inputs 4; QKV input 2, Q and K 4, V 2, attention
projection input 2, its dropout mask 1; MLP: fc1 input 2, GeLU input 8, fc2 input 8, dropout mask 1.
The 5 a s^2 b are the softmax output 2, its dropout mask 1 and the dropout output 2.
"""

from __future__ import annotations

import torch

from .memory_tracker import MemoryTracker


def saved_activation_bytes(module: torch.nn.Module, *inputs, **kwargs) -> int:
    """Activation bytes ``module(*inputs, **kwargs)`` keeps for backward, summed over devices (module docstring)."""
    tracker = MemoryTracker([module])
    with tracker:
        out = module(*inputs, **kwargs)  # noqa: F841 (the graph, and what it saved, lives as long as out)
        live = tracker.live()
    return sum(snap.bytes["activations"] for snap in live.values())


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                            recompute: str | None = None) -> float:
    """Activation bytes of one transformer layer by Korthikanti et al.'s formulas (module docstring).

    ``recompute``: None, ``"selective"`` (needs sequence parallelism when t > 1, as in the paper)
    or ``"full"``.
    """
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        return 34.0 * sbh / t if (sequence_parallel or t == 1) else sbh * (10 + 24 / t)
    if recompute is not None:
        raise ValueError(f"recompute must be None, 'selective' or 'full', got {recompute!r}")
    if sequence_parallel or t == 1:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))
