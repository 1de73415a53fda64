"""Hooks the data-parallel wrappers install: a callback at the start of backward, and forward
pre-hooks that wait for in-flight parameter all-gathers (``--overlap-param-gather``)."""

from __future__ import annotations

import torch
from torch import nn


def on_backward(outputs, fn) -> None:
    """Run ``fn()`` when backward reaches any tensor of ``outputs`` (a tensor, or a tuple/list/dict of
    them): a pre-hook on each output's autograd node, so the outputs themselves stay untouched (no
    view is made: the pipeline can still free a sent activation)."""
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    for t in outputs if isinstance(outputs, (tuple, list)) else [outputs]:
        if torch.is_tensor(t) and t.grad_fn is not None:
            t.grad_fn.register_prehook(lambda grads: fn())


def _waiting_for(buckets):
    def hook(module, args):
        for bucket in buckets:
            bucket.finish_param_gather()

    return hook


def _called(module_names: dict, name: str) -> str:
    """``name`` or its nearest ancestor that has a forward of its own: a plain container (``nn.Module()``,
    ``nn.ModuleList``) holding weights is never called, its parent's forward reads them."""
    while name and type(module_names[name]).forward is nn.Module.forward:
        name = name.rpartition(".")[0]
    return name


def wait_for_params_before_use(module, bucket_of: dict) -> None:
    """--overlap-param-gather with full params: the optimizer's post-step all-gathers run in the
    background; the module whose forward reads a parameter (its owner, or the owner's nearest
    ancestor with a forward) waits for that parameter's bucket just before its forward."""
    modules = dict(module.named_modules())
    waits: dict[str, list] = {}
    for name, m in modules.items():
        for p in m.parameters(recurse=False):
            bucket = bucket_of.get(id(p))
            own = waits.setdefault(_called(modules, name), [])
            if bucket is not None and all(bucket is not b for b in own):
                own.append(bucket)
    for name, buckets in waits.items():
        if buckets:
            modules[name].register_forward_pre_hook(_waiting_for(buckets))
