"""MoE checkpoints saved before the router had a bias: loaded with the bias at zero.

With biases on (no ``--disable-bias-linear``) an MoE layer's router holds ``mlp.router.bias`` [E],
zero-initialised and added to the logits. Checkpoints written before it existed lack the tensor; a
zero bias computes exactly what their model computed, so every loader fills it with zeros (one log
line says so). Any other missing tensor is still refused. The optimizer state of a filled bias
starts fresh (no moments: its first Adam step is a first step).
"""

from __future__ import annotations

import torch

from ..console import print_rank_0

SUFFIX = "mlp.router.bias"
WEIGHT_SUFFIX = "mlp.router.weight"


def is_router_bias(name: str) -> bool:
    return name == SUFFIX or name.endswith("." + SUFFIX)


def say_filled(where: str, names) -> None:
    names = sorted(names)
    if names:
        print_rank_0(f"  {where} has no MoE router bias ({names[0]}{' ...' if len(names) > 1 else ''}: saved before "
                     f"the router had one); loading {len(names)} as zero, which computes what it was saved with")


def fill_state_dict(state_dict: dict, wanted: dict) -> list[str]:
    """Add to ``state_dict`` a zero tensor (like ``wanted[name]``) for each router bias of ``wanted``
    it lacks; returns their names."""
    filled = [k for k, v in wanted.items() if is_router_bias(k) and k not in state_dict and torch.is_tensor(v)]
    for k in filled:
        state_dict[k] = torch.zeros(wanted[k].shape, dtype=wanted[k].dtype)
    return filled


def fill_merged(merged: dict, config: dict, where: str) -> list[str]:
    """A merged (single-process) checkpoint ``merged`` whose saved ``config`` has biases on: a zero
    bias beside each router weight that has none. Returns their names."""
    if config.get("disable_bias_linear", False):
        return []
    filled = []
    for name, weight in list(merged.items()):
        if name.endswith(WEIGHT_SUFFIX):
            bias = name[: -len("weight")] + "bias"
            if bias not in merged:
                merged[bias] = torch.zeros(weight.shape[0], dtype=weight.dtype)
                filled.append(bias)
    say_filled(where, filled)
    return filled


def refuse_optimizer(path: str) -> None:
    from .format import CheckpointError

    raise CheckpointError(f"checkpoint {path} has no MoE router bias (saved before the router had one), so its "
                          "optimizer state lacks that parameter's; pass --no-load-optim (or --finetune) to start "
                          "a fresh optimizer from its weights")
