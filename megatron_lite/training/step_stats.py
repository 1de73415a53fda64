"""The optional per-step figures of Megatron's log line: ``--log-params-norm`` (``params norm``, the
L2 norm of the trained parameters) and ``--log-num-zeros-in-grad`` (``num zeros``, the zero entries
of the gradients the optimizer stepped with, after their reduction over data parallelism).

Both count every parameter of the model once, as if it lived in one process (the rules of the
gradient norm, :mod:`megatron_lite.optim.clip_grads`): a tensor-parallel shard on its own rank, a
TP-replicated tensor (norm weights, a row-parallel bias) and the tied embedding once, a
distributed optimizer's pieces summed over their shard group. The norm reads the fp32 masters the
step wrote (Megatron's main params); a frozen parameter (``--lora-rank``) is not trained and not
counted. Both are collective over the model: every rank computes them, the logging rank prints.
"""

from __future__ import annotations

import math

from ..device import get_device
from ..optim.clip_grads import count_zeros, model_sum, sum_of_squares


def params_norm(optimizer, state) -> float:
    """L2 norm of every trained parameter of the model (after this step)."""
    pairs = optimizer.stat_pairs(grads=False)
    return math.sqrt(model_sum(pairs, state, get_device(), sum_of_squares, optimizer.sharded).item())


def num_zeros_in_grad(optimizer, state) -> int:
    """Zero entries of the model's gradient this step (each parameter once)."""
    pairs = optimizer.stat_pairs(grads=True)
    return int(model_sum(pairs, state, get_device(), count_zeros, optimizer.sharded).item())


def step_stats(config, optimizer, state, ok: bool) -> dict:
    """The keyword arguments of ``TrainLogger.log_iteration`` the flags ask for (none without them);
    a skipped step (fp16 overflow) has no gradient to count: its ``num_zeros`` is None, as in Megatron."""
    stats = {}
    if config.logging.log_num_zeros_in_grad:
        stats["num_zeros"] = num_zeros_in_grad(optimizer, state) if ok else None
    if config.logging.log_params_norm:
        stats["params_norm"] = params_norm(optimizer, state)
    return stats
