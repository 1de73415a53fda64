"""FP8 experts split over expert-tensor-parallel ranks equal the unsharded FP8 experts (gloo, TP 2).

Every rank feeds the same tokens to its expert-tensor shard (fc1 by rows, fc2 by columns); the
partial outputs, input gradients and routing-weight gradients summed over the group, and each
rank's weight-gradient shard, must equal the single-process FP8 experts' within fp32
summation-order differences (1e-5 of the reference's largest value) over three steps in which the
input magnitude changes, so that delayed scales move. The experts' amaxes are MAX-reduced over the
tensor-parallel group, so each shard is quantised with the scale of the whole tensor. The control
without that reduction must miss the tolerance (per-shard scales quantise differently).
"""

import pytest
import torch

from megatron_lite.moe.experts import GroupedExperts, SequentialExperts
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import shard
from megatron_lite.precision.fp8 import fp8_gemms, update_fp8_scales
from tests.harness import cached_state, run_ranks
from tests.moe_helpers import moe_config

TOKENS = [6, 0, 11, 15]
H, FFN = 32, 64


def _experts(cls, state, tp, recipe):
    parallel = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2) if tp else {}
    config = moe_config(hidden_size=H, moe_ffn_hidden_size=FFN, num_experts=4, swiglu=True, fp8="hybrid",
                        fp8_recipe=recipe, fp8_amax_history_len=2, fp8_amax_compute_algo="max",
                        init_method_std=0.05, **parallel)
    return cls(config, state, 1)


def _step(module, step):
    g = torch.Generator().manual_seed(step)
    x = (torch.randn(sum(TOKENS), H, generator=g) * (1 + step)).requires_grad_()
    probs = torch.rand(sum(TOKENS), generator=g).requires_grad_()
    dy = torch.randn(sum(TOKENS), H, generator=g) * 1e-2 * (1 + step)
    module.zero_grad()
    y = module(x, probs, TOKENS)
    y.backward(dy)
    return [y.detach(), x.grad, probs.grad], {n: p.grad.clone() for n, p in module.named_parameters()}


def check_etp2_fp8_experts(kind, recipe, reduce_amax):
    state = cached_state(tp=2)
    cls = SequentialExperts if kind == "sequential" else GroupedExperts
    ref = _experts(cls, ParallelState(world_size=1, rank=0), False, recipe)
    mod = _experts(cls, state, True, recipe)
    gemms = fp8_gemms(mod)
    assert len(gemms) == 8 and all(g.amax_group is state.tp_group and g.expert for g in gemms)
    if not reduce_amax:
        for g in gemms:
            g.amax_group = None
    worst = 0.0
    for step in range(3):
        want, want_grads = _step(ref, step)
        got, grads = _step(mod, step)
        for t in got:  # partial sums over the expert-tensor shards
            torch.distributed.all_reduce(t, group=state.tp_group)
        for name, p in mod.named_parameters():
            got.append(grads[name])
            want.append(shard(want_grads[name], p.partition_dim, state.tp_rank, 2, p.partition_stride))
        for a, b in zip(got, want):
            worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
        update_fp8_scales(ref)
        update_fp8_scales(mod)
    return worst


@pytest.mark.parametrize("kind", ["sequential", "grouped"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_etp2_fp8_experts_equal_unsharded(kind, recipe):
    for worst in run_ranks(2, check_etp2_fp8_experts, kind, recipe, True):
        assert worst < 1e-5, worst  # measured ~5e-7


def test_etp2_fp8_experts_without_amax_reduction_differ():
    assert max(run_ranks(2, check_etp2_fp8_experts, "grouped", "delayed", False)) > 1e-2  # measured ~0.35
