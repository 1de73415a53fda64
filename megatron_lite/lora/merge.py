"""Merge LoRA adapters into their base weights: ``W' = W + (alpha / r) B A``.

Works on single-process state dicts (the layout-free form every checkpoint merges into, see
:mod:`megatron_lite.checkpoint.merge`), so the merged weights can then be written at any layout or
exported to Hugging Face. The sum is computed in fp32 and stored in the base weight's dtype.

Names: a dense or sequential-expert adapter ``<base>.adapter.linear_in.weight`` (A ``[r, in]``) and
``<base>.adapter.linear_out.weight`` (B ``[out, r]``) adapt ``<base>.weight``; grouped experts'
stacked ``mlp.experts.linear_fc{1,2}_adapter.linear_{in,out}.weight`` (A ``[E, in, r]``, B ``[E, r, out]``)
adapt ``mlp.experts.weight{1,2}`` (``[E, in, out]``), so there ``W' = W + (alpha / r) A B``.
"""

from __future__ import annotations

import torch

from ..checkpoint.format import CheckpointError
from .apply import is_adapter_name

IN, OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
GROUPED = {f"linear_fc{i}_adapter.linear_in.weight": f"weight{i}" for i in (1, 2)}


def _pair(state_dict: dict, key_in: str) -> tuple[str, torch.Tensor, torch.Tensor, bool]:
    """(base weight name, A, B, stacked) of the adapter whose A is ``key_in``."""
    prefix, leaf = key_in.rsplit(".", 2)[0], ".".join(key_in.rsplit(".", 2)[1:])
    if key_in.endswith(IN):
        base, stacked = key_in[: -len(IN)] + ".weight", False
        key_out = key_in[: -len(IN)] + OUT
    else:
        parent = prefix.rsplit(".", 1)[0]
        grouped = f"{prefix.rsplit('.', 1)[1]}.{leaf}"
        base, stacked = f"{parent}.{GROUPED[grouped]}", True
        key_out = key_in.replace("linear_in.weight", "linear_out.weight")
    if base not in state_dict or key_out not in state_dict:
        raise CheckpointError(f"adapter {key_in} has no {'base weight ' + base if base not in state_dict else key_out}")
    return base, state_dict[key_in], state_dict[key_out], stacked


def merge_lora(state_dict: dict, alpha: float, rank: int) -> dict:
    """``state_dict`` with every adapter merged into its base weight and the adapter tensors removed."""
    merged = {k: v for k, v in state_dict.items() if not is_adapter_name(k)}
    scale = alpha / rank
    for key in state_dict:
        if not (key.endswith(IN) or any(key.endswith(g) for g in GROUPED)):
            continue
        base, a, b, stacked = _pair(state_dict, key)
        delta = torch.bmm(a.float(), b.float()) if stacked else b.float() @ a.float()
        weight = merged[base]
        if tuple(delta.shape) != tuple(weight.shape):
            raise CheckpointError(f"adapter {key} gives a {tuple(delta.shape)} update for {base} of shape "
                                  f"{tuple(weight.shape)}; the adapters do not fit this base")
        merged[base] = (weight.float() + scale * delta).to(weight.dtype)
    return merged
