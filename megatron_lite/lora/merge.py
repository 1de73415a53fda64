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

import re

import torch

from ..checkpoint.format import CheckpointError
from .apply import is_adapter_name

IN, OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
GROUPED = re.compile(r"^(.*)\.linear_fc([12])_adapter\.linear_in\.weight$")


def _pair(key_in: str) -> tuple[str, str, bool] | None:
    """(base weight name, B's name, stacked) of the adapter whose A is ``key_in``; None if it is no A."""
    if key_in.endswith(IN):  # <base>.adapter.linear_in.weight
        stem = key_in[: -len(IN)]
        return stem + ".weight", stem + OUT, False
    m = GROUPED.match(key_in)  # <experts>.linear_fc{i}_adapter.linear_in.weight
    if m is None:
        return None
    return f"{m.group(1)}.weight{m.group(2)}", key_in.replace(".linear_in.", ".linear_out."), True


def merge_lora(state_dict: dict, alpha: float, rank: int) -> dict:
    """``state_dict`` with every adapter merged into its base weight and the adapter tensors removed."""
    merged = {k: v for k, v in state_dict.items() if not is_adapter_name(k)}
    scale = alpha / rank
    for key in state_dict:
        if (pair := _pair(key)) is None:
            continue
        base, key_out, stacked = pair
        if base not in state_dict or key_out not in state_dict:
            raise CheckpointError(f"adapter {key} has no {base if base not in state_dict else key_out}")
        a, b = state_dict[key], state_dict[key_out]
        delta = torch.bmm(a.float(), b.float()) if stacked else b.float() @ a.float()
        weight = merged[base]
        if tuple(delta.shape) != tuple(weight.shape):
            raise CheckpointError(f"adapter {key} gives a {tuple(delta.shape)} update for {base} of shape "
                                  f"{tuple(weight.shape)}; the adapters do not fit this base")
        merged[base] = (weight.float() + scale * delta).to(weight.dtype)
    return merged
