"""The live-tensor tracker on data-parallel ranks: model state equals the formula, communication
buffers are counted while they live.

The toy model of test_fsdp.py (two units of 72 parameters and a root head of 36: no bucket needs
padding at DP 2) takes one step under ``MemoryTracker`` for every sharding strategy. Afterwards
the tracker's parameters, gradients and optimizer state equal the storages
:func:`measured_model_state_bytes` finds (optimizer state: plus Adam's fp32 step counts, one per
parameter tensor the optimizer holds), which equal :func:`model_state_bytes_per_param` times the
parameter count, and no communication buffer is left alive. While ZeRO-3 runs a unit's forward,
exactly that unit and the root (the head, gathered for the whole forward pass) are live as
communication buffers; an all-gather's input and output are communication buffers of their size;
``settle()`` waits until a collective's buffer that another thread still holds is let go. With
hybrid sharding (2 instances at DP 4, ZeRO-1/2/3) the same holds at the formula's d/N: the
instances' all-reduce of the gradient shards leaves nothing behind.
"""

import threading

import pytest
import torch
import torch.distributed as dist

from megatron_lite.config import ModelConfig
from megatron_lite.models import GPTModel
from megatron_lite.parallel.fsdp import FullyShardedDataParallel
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.parallel.state import ParallelState
from megatron_lite.perf.memory_tracker import MemoryTracker
from megatron_lite.perf.model_state import measured_model_state_bytes, model_state_bytes_per_param
from tests.distributed.test_fsdp import STRATEGIES, _build, _step
from tests.harness import cached_state, run_ranks
from tests.model_helpers import transformer_config

CPU = torch.device("cpu")
N = 180  # parameters of the toy model


def _after_one_step(dp, instances=1):
    state = cached_state(dp=dp, dist_opt_instances=instances)
    out = {}
    for strategy in STRATEGIES if instances == 1 else STRATEGIES[1:]:  # hybrid: the sharded strategies
        model, opt = _build(state, torch.float32, strategy)
        tracker = MemoryTracker([model], opt)
        with tracker:
            ok, _ = _step(model, opt, state)
            tracker.settle()  # gloo's worker thread may still hold the step's all-reduced scalars
            live = tracker.live()[CPU].bytes
        assert ok
        counters = 4 * len(opt.optimizer.state)
        out[strategy] = live, measured_model_state_bytes([model], opt), counters, tracker.peak[CPU].bytes
    return out


@pytest.mark.parametrize("dp, instances", [(2, 1), (4, 2)], ids=["dp2", "dp4_hybrid2"])
def test_model_state_categories_equal_the_formula_for_every_strategy(dp, instances):
    """Also hybrid sharding (HSDP with ZeRO-2/3): 2 instances of 2 ranks at DP 4, the formula at d/N = 2."""
    for rank, per_strategy in enumerate(run_ranks(dp, _after_one_step, dp, instances)):
        assert len(per_strategy) == (4 if instances == 1 else 3)
        for strategy, (live, measured, counters, peak) in per_strategy.items():
            where = (rank, strategy, live)
            assert live["parameters"] == measured["params"], where
            assert live["gradients"] == measured["grads"], where
            assert live["optimizer state"] == measured["optimizer"] + counters, where
            model_state = live["parameters"] + live["gradients"] + live["optimizer state"] - counters
            assert model_state == model_state_bytes_per_param(torch.float32, strategy, dp, instances=instances) * N, where
            assert live["communication"] == 0 and live["activations"] == 0, where
            assert peak["parameters"] == live["parameters"], where


def _gathered_during_forward():
    state = cached_state(dp=2)
    model, opt = _build(state, torch.float32, "optim_grads_params")
    tracker = MemoryTracker([model], opt)
    seen = []
    model.module.blocks[0].register_forward_pre_hook(lambda *_: seen.append(tracker.live()[CPU].bytes["communication"]))
    with tracker:
        _step(model, opt, state)
        x = torch.randn(256)
        out = torch.empty(512)
        dist.all_gather_into_tensor(out, x, group=state.dp_group)
        collective = tracker.live()[CPU].bytes["communication"]
        del x, out
        tracker.settle(timeout=60)
        held = _all_reduced_scalar_held_by_a_thread(state)
        before_settling = tracker.live()[CPU].bytes["communication"]
        tracker.settle(timeout=60)
        after_settling = tracker.live()[CPU].bytes["communication"]
        held.join()
    return seen, collective, before_settling, after_settling


def _all_reduced_scalar_held_by_a_thread(state):
    """An all-reduced fp32 scalar whose last reference a thread drops half a second later, as gloo's
    worker thread does (within milliseconds) with a finished collective's tensors."""
    t = torch.ones(())
    dist.all_reduce(t, group=state.dp_group)
    holder = threading.Timer(0.5, lambda kept=[t]: kept.clear())
    holder.start()
    return holder


def test_zero3_units_and_collective_buffers_are_communication():
    for seen, collective, before_settling, after_settling in run_ranks(2, _gathered_during_forward):
        assert seen == [(72 + 36) * 4]  # block 0 and the root, fp32; block 1 not yet gathered
        assert collective == (256 + 512) * 4
        assert (before_settling, after_settling) == (4, 0)  # settle() waits for the held scalar


def test_zero3_root_gradients_do_not_wait_for_the_tied_embedding():
    state = ParallelState()
    model_parallel_seed(3, state)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64)
    gpt = GPTModel(transformer_config(cfg, state), state, pre_process=True, post_process=True)
    model = FullyShardedDataParallel(gpt, state)
    assert [len(b.params) for b in model.root.buckets] == [1] * len(model.root.buckets) and len(model.root.buckets) > 1
    root_bytes = 4 * sum(b.numel for b in model.root.buckets)  # fp32, gathered: embedding and final norm
    tracker = MemoryTracker([model])
    seen = []
    for layer in gpt.decoder.layers:
        layer.register_full_backward_pre_hook(lambda *_: seen.append(tracker.live()[CPU].bytes["communication"]))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with tracker:
        model(tokens, labels=tokens).sum().backward()
    assert seen == [root_bytes, root_bytes]
