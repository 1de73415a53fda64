"""An MoE layer split over expert (and tensor + sequence) parallel ranks equals the single-process layer.

Expert parallelism lives inside data parallelism, so data-parallel rank d holds its own tokens
``x_d``. The reference is the single-process layer (same seeded weights) run on each ``x_d``
separately. On every rank: the output and input gradient equal the reference's for its data (its
sequence chunk under SP); a dense parameter's gradient (router, shared experts; summed over TP
when it is marked ``sequence_parallel``) equals the reference gradient of its data; an expert
parameter's gradient equals this rank's slice (local experts, expert-tensor shard) of the
reference gradient summed over all data ranks, since the expert saw all their tokens. The
logged auxiliary-loss values (summed over TP) equal the reference's. fp32, rtol 1e-5 / atol 1e-6.
"""

import pytest
import torch

from megatron_lite.moe.layer import MoELayer
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import all_reduce_sequence_parallel_grads, shard
from tests.harness import cached_state, run_ranks
from tests.moe_helpers import moe_config

S, B = 8, 2


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _reference(overrides, xs, dys):
    """Per data rank: output, input grad, parameter grads and logged losses of the single-process layer."""
    ref = MoELayer(moe_config(**overrides), ParallelState(world_size=1, rank=0), 1)
    ref.train()
    runs = []
    for x, dy in zip(xs, dys):
        ref.zero_grad()
        ref.router.metrics = {}
        x = x.clone().requires_grad_()
        y = ref(x)
        y.backward(dy)
        grads = {name: p.grad.clone() for name, p in ref.named_parameters()}
        runs.append((y.detach(), x.grad, grads, dict(ref.router.metrics)))
    return runs


def _expected_grad(name, param, runs, mine, layer, state):
    """The reference gradient this rank's ``param`` must have (see the module docstring)."""
    first = layer.experts.first_expert
    if getattr(param, "is_expert", False):
        if name.startswith("experts.local_experts."):
            j, rest = name[len("experts.local_experts."):].split(".", 1)
            ref_name, index = f"experts.local_experts.{first + int(j)}.{rest}", None
        else:
            ref_name, index = name, slice(first, first + layer.experts.num_local_experts)
        expected = sum(run[2][ref_name] for run in runs)
        expected = expected if index is None else expected[index]
    else:
        expected = runs[mine][2][name]
    if getattr(param, "tensor_model_parallel", False) and state.tp_size > 1:
        expected = shard(expected, param.partition_dim, state.tp_rank, state.tp_size, param.partition_stride)
    return expected


def check_layer(ep, tp, overrides):
    state = cached_state(ep=ep, tp=tp)
    xs = [torch.randn(S, B, 16, generator=torch.Generator().manual_seed(10 + d)) for d in range(state.dp_size)]
    dys = [torch.randn(S, B, 16, generator=torch.Generator().manual_seed(50 + d)) for d in range(state.dp_size)]
    runs = _reference(overrides, xs, dys)
    config = moe_config(sequence_parallel=tp > 1, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                        **overrides)
    layer = MoELayer(config, state, 1)
    layer.train()
    mine = state.dp_rank

    def local(t):
        return t.chunk(tp, dim=0)[state.tp_rank]

    x = local(xs[mine]).clone().requires_grad_()
    y = layer(x)
    y.backward(local(dys[mine]))
    _close(y, local(runs[mine][0]), "output")
    _close(x.grad, local(runs[mine][1]), "input grad")
    params = dict(layer.named_parameters())
    for param in params.values():  # fc2's expert bias is only used on expert-tensor rank 0
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    all_reduce_sequence_parallel_grads(params.values(), state.tp_group)
    assert set(params) <= set(runs[0][2]) or layer.experts.num_local_experts < config.num_experts
    for name, param in params.items():
        _close(param.grad, _expected_grad(name, param, runs, mine, layer, state), f"grad of {name}")
    for name, value in layer.router.metrics.items():
        total = value.clone()
        if state.tp_group is not None:
            torch.distributed.all_reduce(total, group=state.tp_group)
        _close(total, runs[mine][3][name], f"logged {name}")
    assert set(layer.router.metrics) == set(runs[mine][3])
    return True


LOSSES = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
CASES = {
    "ep2-alltoall-swiglu-losses": (2, 1, dict(swiglu=True, **LOSSES)),
    "ep2-allgather-bias": (2, 1, dict(moe_token_dispatcher_type="allgather", add_bias_linear=True, **LOSSES)),
    "ep4-alltoall-grouped": (4, 1, dict(num_experts=8, moe_grouped_gemm=True, swiglu=True, **LOSSES)),
    "ep4-allgather-seq-aux": (4, 1, dict(moe_token_dispatcher_type="allgather",
                                         moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01)),
    "ep2-capacity-drop": (2, 1, dict(moe_expert_capacity_factor=1.0, **LOSSES)),
    "ep2-capacity-pad-position": (2, 1, dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                                             moe_token_drop_policy="position")),
    "tp2-sp": (1, 2, dict(swiglu=True, add_bias_linear=True, **LOSSES)),
    "ep2-tp2-sp-alltoall-shared-bias": (2, 2, dict(swiglu=True, add_bias_linear=True,
                                                   moe_shared_expert_intermediate_size=16, **LOSSES)),
    "ep2-tp2-sp-allgather-grouped": (2, 2, dict(moe_token_dispatcher_type="allgather", moe_grouped_gemm=True,
                                                add_bias_linear=True, **LOSSES)),
    "ep2-tp2-sp-etp1-alltoall": (2, 2, dict(expert_tensor_parallel_size=1, swiglu=True, add_bias_linear=True,
                                            moe_shared_expert_intermediate_size=16, **LOSSES)),
    "ep2-tp2-sp-etp1-allgather-grouped": (2, 2, dict(expert_tensor_parallel_size=1, moe_grouped_gemm=True,
                                                     moe_token_dispatcher_type="allgather", **LOSSES)),
    "tp2-sp-quick-geglu-gpt-oss-grouped-bias": (1, 2, dict(quick_geglu=True, glu_linear_offset=1.0,
                                                          activation_func_clamp_value=0.5, moe_grouped_gemm=True,
                                                          add_bias_linear=True, moe_shared_expert_intermediate_size=16,
                                                          **LOSSES)),
    "ep2-tp2-sp-squared-relu-bias": (2, 2, dict(squared_relu=True, use_fused_weighted_squared_relu=True,
                                                add_bias_linear=True, **LOSSES)),
    "ep2-sinkhorn-top1": (2, 1, dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1)),
    "ep2-sigmoid-groups-bias": (2, 1, dict(num_experts=8, moe_router_score_function="sigmoid",
                                           moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                                           moe_router_group_topk=2, moe_router_topk_scaling_factor=2.0,
                                           moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_matches_single_process(case):
    ep, tp, overrides = CASES[case]
    assert all(run_ranks(ep * tp, check_layer, ep, tp, overrides))


def check_bf16(ep, tp):
    """bf16 weights and activations at EP x TP against the fp32 single-process layer: output and input
    gradient within 3e-2 of the reference's scale (bf16 keeps 8 bits of mantissa)."""
    state = cached_state(ep=ep, tp=tp)
    overrides = dict(swiglu=True, moe_grouped_gemm=True, moe_shared_expert_intermediate_size=16, **LOSSES)
    xs = [torch.randn(S, B, 16, generator=torch.Generator().manual_seed(10 + d)) for d in range(state.dp_size)]
    dys = [torch.randn(S, B, 16, generator=torch.Generator().manual_seed(50 + d)) for d in range(state.dp_size)]
    runs = _reference(overrides, xs, dys)
    config = moe_config(sequence_parallel=tp > 1, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                        params_dtype=torch.bfloat16, moe_router_dtype="fp32", **overrides)
    layer = MoELayer(config, state, 1)
    layer.train()
    mine = state.dp_rank
    x = xs[mine].chunk(tp, dim=0)[state.tp_rank].bfloat16().requires_grad_()
    y = layer(x)
    y.backward(dys[mine].chunk(tp, dim=0)[state.tp_rank].bfloat16())
    assert y.dtype == torch.bfloat16
    for actual, expected in ((y, runs[mine][0]), (x.grad, runs[mine][1])):
        expected = expected.chunk(tp, dim=0)[state.tp_rank]
        err = (actual.float() - expected).abs().max().item()
        assert err <= 3e-2 * expected.abs().max().item(), err
    return True


@pytest.mark.parametrize("ep,tp", [(2, 1), (2, 2)])
def test_bf16_moe_layer_close_to_fp32(ep, tp):
    assert all(run_ranks(ep * tp, check_bf16, ep, tp))
