"""Hooks the data-parallel wrappers install: a callback at the start of backward, and forward
pre-hooks that wait for in-flight parameter all-gathers (``--overlap-param-gather``)."""

from __future__ import annotations

import torch


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


def wait_for_params_before_use(module, bucket_of: dict) -> None:
    """--overlap-param-gather with full params: the optimizer's post-step all-gathers run in the
    background; each submodule waits for the buckets of its own parameters (``bucket_of[id(p)]``)
    just before its forward, in the order the forward reaches them."""
    for m in module.modules():
        own = []
        for p in m.parameters(recurse=False):
            bucket = bucket_of.get(id(p))
            if bucket is not None and all(bucket is not b for b in own):
                own.append(bucket)
        if own:
            m.register_forward_pre_hook(_waiting_for(own))
