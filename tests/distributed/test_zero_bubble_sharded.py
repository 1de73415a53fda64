"""ZeRO-2/3 under zero-bubble weight-gradient deferral, at the bucket level (DP2, a tiny GPT).

Two micro-batches in the order a ZB-H1 rank that holds W passes back runs them (B0, B1, W0, W1:
a W after another micro-batch's B) against plain backwards (1F1B's B0, B1). After every pass,
B or W, no full-size gradient buffer is left (what the pass produced was reduce-scattered at its
end: a W pass is a backward of its own, not started at the chunk's output); the gradient shards
after the step equal the plain run's bit for bit (each element is reduced in the pass that computed
it, zeros elsewhere). ZeRO-3: during B the units are gathered and freed as in the plain backward
(a deferred weight's bucket does not wait for the W gradient to free its unit), and a W pass gathers
nothing (dW = dY^T X reads the stashed activations, not the weight), leaving every unit freed.
"""

from contextlib import nullcontext

import pytest
import torch

from megatron_lite.config import ModelConfig, ParallelConfig
from megatron_lite.models import GPTModel
from megatron_lite.parallel import fsdp
from megatron_lite.parallel.pipeline.wgrad import WeightGradStore
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.perf.comm_volume import CommVolume
from tests.harness import cached_state, run_ranks
from tests.model_helpers import transformer_config


class _Stage:
    """The data-parallel state, seen as one stage of a 2-stage pipeline (what makes the wrapper expect W)."""

    pp_size = 2

    def __init__(self, state):
        self._state = state

    def __getattr__(self, name):
        return getattr(self._state, name)


def _model(state, strategy, split):
    model_parallel_seed(3, state)
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                      untie_embeddings_and_output_weights=True)  # tied: the two halves of one PP>1 model
    gpt = GPTModel(transformer_config(cfg, state), state, pre_process=True, post_process=True)
    parallel = ParallelConfig(data_parallel_sharding_strategy=strategy, pipeline_schedule="zb-h1" if split else "1f1b")
    return fsdp.wrap_for_data_parallel(gpt, _Stage(state), parallel)


def _watch_gathers(model, log):
    """Record, at every unit gather, how many units are gathered (ZeRO-3; nothing otherwise)."""
    for unit in getattr(model, "units", []):
        def gather(unit=unit, original=unit.ensure_gathered):
            original()
            log.append(sum(u.gathered for u in model.units))
        unit.ensure_gathered = gather


def _run(strategy, deferred, split=True):  # (no optimizer: buckets all-reduce, the shard is kept all the same)
    state = cached_state(dp=2)
    model = _model(state, strategy, split)
    volume = CommVolume()
    model.zero_grad_buffer()
    gathers, w_gathers = [], []
    _watch_gathers(model, gathers)
    store = WeightGradStore()
    tokens = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * state.dp_rank + i))
              for i in range(2)]
    with store.installed(model), volume.counting():  # the same GEMMs either way; only collect() defers
        for t in tokens:
            loss = model(t, labels=t).sum()
            with store.collect() if deferred else nullcontext():
                loss.backward()
            assert all(b.data is None for b in model.buckets), "a B left a full gradient buffer"
        during_b = list(gathers)
        for _ in range(store.num_pending):
            gathers.clear()
            store.flush()
            w_gathers += gathers
            assert all(b.data is None for b in model.buckets), "a W left a full gradient buffer"
            assert not any(u.gathered for u in getattr(model, "units", [])), "a W left a unit gathered"
    model.finish_grad_sync()
    return model.grad_shards.clone(), during_b, w_gathers, CommVolume.per_kind(volume.current)["dp"]


def _check(strategy):
    ref, ref_b, _, ref_bytes = _run(strategy, deferred=False)
    got, got_b, w_gathers, got_bytes = _run(strategy, deferred=True)
    assert torch.equal(got, ref)
    assert got_bytes == ref_bytes > 0  # each bucket reduce-scattered once per micro-batch, as without deferral
    _, _, _, mixed_bytes = _run(strategy, deferred=True, split=False)  # the wrapper not told: buckets mix B and W
    assert mixed_bytes > ref_bytes  # (the control: those buckets are reduce-scattered by both passes)
    assert got_b == ref_b  # the same gathers, each with as many units held, during B
    assert w_gathers == []
    if strategy == "optim_grads_params":
        assert max(ref_b) <= 2


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_deferred_weight_gradients_are_reduce_scattered_by_their_w_pass(strategy):
    run_ranks(2, _check, strategy)
