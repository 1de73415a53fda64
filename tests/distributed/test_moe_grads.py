"""Expert gradients through data parallelism: DDP averages them over the expert-data-parallel group
and the global grad norm counts each expert once.

World 4 with EP 2 (expert-DP 2) or EP 4, and EP 2 x TP 2 + SP; and folded expert grids (TP 2 with
ETP 1 x EP 4; TP 1 with ETP 2 x EP 2 or ETP 2 x EP 1 x expert-DP 2). Data-parallel rank d holds its own
tokens; the reference is the single-process layer whose loss is the mean over the d batches.
After ``finalize_model_grads`` every ``main_grad`` must be this rank's slice of the reference
gradient, and ``get_grad_norm`` the reference's norm. Then one expert-bias step: the bias moves by
the sign of the token counts summed over all ranks. fp32, rtol 1e-5.
"""

import pytest
import torch

from megatron_lite.moe.layer import MoELayer
from megatron_lite.optim.clip_grads import get_grad_norm
from megatron_lite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import shard
from tests.harness import cached_state, run_ranks
from tests.moe_helpers import moe_config

S, B = 4, 2
OVERRIDES = dict(num_experts=8, swiglu=True, add_bias_linear=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                 moe_shared_expert_intermediate_size=8, moe_router_score_function="sigmoid",
                 moe_router_enable_expert_bias=True)


def _data(dp):
    gens = [torch.Generator().manual_seed(10 + d) for d in range(dp)]
    return [(torch.randn(S, B, 16, generator=g), torch.randn(S, B, 16, generator=g)) for g in gens]


def _reference(data):
    ref = MoELayer(moe_config(**OVERRIDES), ParallelState(world_size=1, rank=0), 1)
    ref.train()
    ref.router.aux_loss_backward_scale = 1.0 / len(data)
    for x, dy in data:
        (ref(x) * dy).sum().div(len(data)).backward()
    return ref


def check_ddp(ep, tp, etp=None):
    state = cached_state(ep=ep, tp=tp, etp=etp)
    data = _data(state.dp_size)
    ref = _reference(data)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    layer = MoELayer(moe_config(sequence_parallel=tp > 1, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                expert_tensor_parallel_size=etp, **OVERRIDES), state, 1)
    layer.train()
    ddp = DistributedDataParallel(layer, state)
    x, dy = (t.chunk(tp, dim=0)[state.tp_rank] for t in data[state.dp_rank])
    (ddp(x) * dy).sum().backward()
    finalize_model_grads([ddp], state)
    first = layer.experts.first_expert
    for name, p in layer.named_parameters():
        if name.startswith("experts.local_experts."):
            j, rest = name[len("experts.local_experts."):].split(".", 1)
            expected = ref_grads[f"experts.local_experts.{first + int(j)}.{rest}"]
        else:
            expected = ref_grads[name]
        rank, size = (state.etp_rank, state.etp_size) if getattr(p, "is_expert", False) else (state.tp_rank, tp)
        if getattr(p, "tensor_model_parallel", False) and size > 1:
            expected = shard(expected, p.partition_dim, rank, size, p.partition_stride)
        torch.testing.assert_close(p.main_grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert getattr(p, "allreduce", True) == (not getattr(p, "is_expert", False))  # EP > 1 here
    ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in ref_grads.values())).item()
    norm = get_grad_norm(list(layer.parameters()), state)
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
    # expert bias: counts summed over every data and tensor rank, then one sign step
    layer.router.finish_step()
    ref.router.finish_step()
    torch.testing.assert_close(layer.router.expert_bias, ref.router.expert_bias)
    assert layer.router.expert_bias.abs().sum() > 0
    return True


# the last three fold the experts' grid (ETP x EP x expert-DP re-cut from TP x DP): TP 2 attention with
# whole experts over EP 4; TP 1 with experts split over ETP 2 x EP 2, or ETP 2 x expert-DP 2
@pytest.mark.parametrize("ep,tp,etp", [(2, 1, None), (4, 1, None), (2, 2, None), (2, 2, 1), (4, 2, 1), (2, 1, 2),
                                       (1, 1, 2)])
def test_expert_grads_reduced_over_expert_dp_and_counted_once(ep, tp, etp):
    assert all(run_ranks(4, check_ddp, ep, tp, etp))


METRIC_OVERRIDES = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.01, 0.02],
                        moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=1.0)


def check_logged_losses(ep, tp):
    """The logged router losses after the reduction (sum over TP, mean over DP) equal the mean over
    the data ranks of the single-process layer's values; dropped tokens are summed over all ranks."""
    from megatron_lite.moe.metrics import dropped_tokens, reduce_moe_losses, tracked_loss_names

    state = cached_state(ep=ep, tp=tp)
    data = _data(state.dp_size)
    config = moe_config(sequence_parallel=tp > 1, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                        **METRIC_OVERRIDES)
    layer = MoELayer(config, state, 2)
    layer.train()
    x, dy = (t.chunk(tp, dim=0)[state.tp_rank] for t in data[state.dp_rank])
    (layer(x) * dy).sum().backward()
    names = tracked_loss_names(config)
    logged = reduce_moe_losses([layer], state, names, config.num_layers, num_microbatches=1)
    dropped = dropped_tokens([layer], state)
    ref = MoELayer(moe_config(**METRIC_OVERRIDES), ParallelState(world_size=1, rank=0), 2)
    ref.train()
    for xd, dyd in data:
        (ref(xd) * dyd).sum().backward()
    assert sorted(names) == ["load_balancing_loss", "seq_load_balancing_loss", "z_loss"]
    for name in names:
        assert logged[name][0] == 0  # layer 1 is not this layer
        expected = ref.router.metrics[name] / len(data)
        torch.testing.assert_close(logged[name][1], expected, rtol=1e-5, atol=1e-6)
    if tp == 1:  # capacity depends on the tokens per rank, which SP changes
        assert dropped == ref.router.num_dropped_tokens > 0
    return True


@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 1), (2, 2)])
def test_logged_router_losses_match_single_process(ep, tp):
    assert all(run_ranks(4, check_logged_losses, ep, tp))
