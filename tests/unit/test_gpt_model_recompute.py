"""Activation recomputation in GPTModel, one process: full recomputation checkpoints exactly the layers
``--recompute-method`` / ``--recompute-num-layers`` name, and every recomputation mode gives the losses
and gradients of no recomputation, with dropout on (the RNG states are replayed). Model and batch
helpers are test_gpt_model.py's."""

import dataclasses

import pytest
import torch

from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.parallel.state import ParallelState
from tests.model_helpers import build_gpt
from tests.unit.test_gpt_model import _close, _grads, make_batch, make_config


@pytest.mark.parametrize("method, n, groups, runs", [
    ("uniform", 1, [[0], [1], [2]], [2, 2, 2]),
    ("uniform", 2, [[0, 1], [2]], [2, 2, 2]),  # the last group takes what is left
    ("block", 1, [[0]], [2, 1, 1]),
    ("block", 2, [[0], [1]], [2, 2, 1]),  # the first n layers, one checkpoint each
])
def test_full_recompute_checkpoints_the_layers_the_method_names(monkeypatch, method, n, groups, runs):
    """parallelism.md: uniform checkpoints groups of n layers (the last takes what is left), block the
    first n layers of the chunk. The equality tests cannot see which layers are checkpointed (a
    recomputed layer gives the same numbers), so the layers each checkpoint runs in forward, and how
    often each layer runs in forward + backward, are recorded here (3 layers)."""
    from megatron_lite.models import transformer

    model = build_gpt(make_config("A", num_layers=3), ParallelState(), recompute_granularity="full",
                      recompute_method=method, recompute_num_layers=n)
    log = {"group": None, "groups": [], "runs": [0, 0, 0]}

    def pre_hook(i):
        def hook(module, args, kwargs):
            log["runs"][i] += 1
            if log["group"] is not None:
                log["group"].append(i)
        return hook

    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True)
    real = transformer.checkpoint

    def recording_checkpoint(*args, **kwargs):
        log["group"] = []
        try:
            return real(*args, **kwargs)
        finally:
            log["groups"].append(log["group"])
            log["group"] = None

    monkeypatch.setattr(transformer, "checkpoint", recording_checkpoint)
    tokens, labels = make_batch(2)
    model(tokens, labels=labels).mean().backward()
    assert (log["groups"], log["runs"]) == (groups, runs)


@pytest.mark.parametrize("variant", ["A", "B"])
@pytest.mark.parametrize("recompute", [("full", "uniform", 1), ("full", "uniform", 2), ("full", "block", 1),
                                       ("selective", None, None)])
def test_recompute_equals_no_recompute_with_dropout(variant, recompute):
    cfg = make_config(variant, dropout=0.2)
    tokens, labels = make_batch(2)

    def run(granularity, method, n):
        state = ParallelState()
        model_parallel_seed(11, state)  # same masks for both runs
        model = build_gpt(cfg, state, seed=5, recompute_granularity=granularity, recompute_method=method,
                          recompute_num_layers=n)
        loss = model(tokens, labels=labels)
        loss.mean().backward()
        return loss.detach(), _grads(model)

    loss_ref, grads_ref = run(None, None, None)
    loss, grads = run(*recompute)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)  # forward is the very same computation
    for name in grads_ref:
        _close(grads[name], grads_ref[name], name, atol=1e-7)
    state = ParallelState()
    model_parallel_seed(11, state)
    no_dropout = build_gpt(dataclasses.replace(cfg, attention_dropout=0.0, hidden_dropout=0.0), state, seed=5)
    assert not torch.allclose(no_dropout(tokens, labels=labels), loss_ref)  # dropout really was on
