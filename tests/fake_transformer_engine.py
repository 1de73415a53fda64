"""A stand-in ``transformer_engine`` package for testing the ``--transformer-impl transformer_engine``
wiring on a machine without Transformer Engine or a GPU.

It offers the pieces :mod:`megatron_lite.precision.te` uses (``transformer_engine.pytorch.Linear``
and ``fp8_autocast``; ``transformer_engine.common.recipe.Format``, ``DelayedScaling``,
``Float8CurrentScaling``), records every Linear call with the autocast settings active at that
moment, and computes the GEMM in fp32 (no FP8). Its own Linear weight is NaN, so an output that is
finite proves the call ran on the weight the caller supplied. ``install(monkeypatch)`` puts it in
``sys.modules`` and reports a GPU as visible; it returns the list the calls are recorded in.
"""

import enum
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.precision import flags


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass
class DelayedScaling:  # TE's defaults (they differ from Megatron's flag defaults)
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    override_linear_precision: tuple = (False, False, False)


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID


@dataclass
class Float8BlockScaling:  # TE's default format for the block-scaled recipes is E4M3
    fp8_format: Format = Format.E4M3


@dataclass
class MXFP8BlockScaling:
    fp8_format: Format = Format.E4M3


def _build(calls: list):
    active = []

    @contextmanager
    def fp8_autocast(enabled=True, fp8_recipe=None, fp8_group=None):
        active.append(dict(enabled=enabled, recipe=fp8_recipe, group=fp8_group))
        try:
            yield
        finally:
            active.pop()

    class Linear(nn.Module):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__()
            assert bias is False  # the bias stays in our layers
            self.weight = nn.Parameter(torch.full((out_features, in_features), float("nan"), dtype=params_dtype,
                                                  device=device))

        def forward(self, inp, is_first_microbatch=None):
            calls.append(dict(active[-1] if active else {}, shape=tuple(self.weight.shape), rows=inp.shape[0]))
            return F.linear(inp.float(), self.weight.float()).to(inp.dtype)

    root = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.Linear, pytorch.fp8_autocast = Linear, fp8_autocast
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.DelayedScaling, recipe.Float8CurrentScaling = Format, DelayedScaling, Float8CurrentScaling
    recipe.Float8BlockScaling, recipe.MXFP8BlockScaling = Float8BlockScaling, MXFP8BlockScaling
    root.pytorch, root.common, common.recipe = pytorch, common, recipe
    return {"transformer_engine": root, "transformer_engine.pytorch": pytorch,
            "transformer_engine.common": common, "transformer_engine.common.recipe": recipe}


def install(monkeypatch, gpu: bool = True) -> list:
    """Make the fake importable (and a GPU 'visible' when ``gpu``); returns the call log."""
    calls = []
    for name, module in _build(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(flags, "gpu_visible", lambda: gpu)
    return calls
