"""The dense MLP with --quick-geglu (gpt-oss: offset 1, a clamp that acts) and with --squared-relu at
TP 2 (with and without sequence parallelism) equals the one-process MLP: output, input gradient and
every weight's gradient (this rank's shard of the reference's; fc1 split with stride 2 for the gated
halves), fp32 rtol 1e-5 / atol 1e-6. MoE layers with these activations: test_moe_layer.py."""

import pytest
import torch

from megatron_lite.models.mlp import MLP
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import shard
from tests.harness import cached_state, run_ranks

S, B, H = 8, 2, 16
ACTIVATIONS = {
    "quick-geglu": dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.5),
    "squared-relu": dict(squared_relu=True),
}


def _config(over, tp=1, sp=False):
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=12, init_method_std=0.5,
                             bias_activation_fusion=True, tensor_model_parallel_size=tp, sequence_parallel=sp, **over)


def _run(state, over, sp):
    mlp = MLP(_config(over, state.tp_size, sp), state, 1)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    if sp:
        x, dy = x.chunk(state.tp_size)[state.tp_rank], dy.chunk(state.tp_size)[state.tp_rank]
    x = x.clone().requires_grad_()
    y = mlp(x)
    y.backward(dy)
    grads = {}
    for name, p in mlp.named_parameters():
        grad = p.grad
        if getattr(p, "sequence_parallel", False) and state.tp_size > 1:  # replicated bias under SP
            torch.distributed.all_reduce(grad, group=state.tp_group)
        grads[name] = (grad, getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1))
    return y.detach(), x.grad, grads


def _tp2(over, sp):
    return _run(cached_state(tp=2), over, sp)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_dense_mlp_tp2_equals_one_process(name, sp):
    want_y, want_dx, want_grads = _run(ParallelState(world_size=1, rank=0), ACTIVATIONS[name], False)
    for rank, (y, dx, grads) in enumerate(run_ranks(2, _tp2, ACTIVATIONS[name], sp)):
        part = (lambda t, r=rank: t.chunk(2)[r]) if sp else (lambda t: t)
        torch.testing.assert_close(y, part(want_y), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx, part(want_dx), rtol=1e-5, atol=1e-6)
        for key, (grad, dim, stride) in grads.items():
            want = want_grads[key][0]
            want = want if dim is None else shard(want, dim, rank, 2, stride)
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
