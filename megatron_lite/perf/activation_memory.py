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

:func:`mla_layer_bytes` is the same account for a multi-latent-attention layer (the MLP part kept as
the formula's 4h GeLU MLP): the attention terms per token become the down projections' input 2h
(shared by the q and kv down projections), the q latent's norm input and up-projection input
4 rq (with q compression), the kv latent's 4 rkv, the rotary key (one for all heads) 2 dr, Q and K
2 a (dn + dr) each, V 2 a dv, the output projection's input 2 a dv and the dropout mask h. The down projections and latents are
replicated over TP (sharded over the sequence with sequence parallelism), the per-head tensors split
over TP. With ``rkv = dr = 0``, no q compression and ``dn = dv = h / a`` it is Korthikanti's layer.
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


def mla_layer_bytes(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool, recompute: str | None,
                    q_lora_rank: int | None, kv_lora_rank: int, qk_head_dim: int, qk_pos_emb_head_dim: int,
                    v_head_dim: int) -> float:
    """Activation bytes of one multi-latent-attention layer (module docstring), same ``recompute``
    choices as :func:`korthikanti_layer_bytes`."""
    if recompute == "full":
        return 2.0 * s * b * h / (t if sequence_parallel else 1)
    if recompute not in (None, "selective"):
        raise ValueError(f"recompute must be None, 'selective' or 'full', got {recompute!r}")
    latents = 4 * (q_lora_rank or 0) + 4 * kv_lora_rank + 2 * qk_pos_emb_head_dim
    replicated = 10 * h + latents  # norms 4h, down-projection input 2h, latents and rotary key, masks 2h, fc1 input 2h
    split = 4 * a * (qk_head_dim + qk_pos_emb_head_dim) + 4 * a * v_head_dim + 16 * h  # Q, K, V, proj input; MLP
    per_token = replicated / (t if sequence_parallel else 1) + split / t
    core = 0.0 if recompute == "selective" else 5.0 * a * s * s * b / t
    return s * b * per_token + core
