"""The Mamba-2 mixer at TP 2, with and without sequence parallelism, against the one-process mixer.

Each rank holds one of the two groups (its heads, conv1d channels, A_log, D, dt_bias and gated-norm
weights) sliced from the same master weights; in_proj is column-parallel and out_proj row-parallel
(all-gather / reduce-scatter of the sequence under SP). Output, input gradient and every parameter's
gradient (this rank's slice of the one-process gradient) are equal to rtol 1e-5.
"""

import pytest
import torch

from megatron_lite.models.mamba import MambaMixer
from megatron_lite.parallel import comm
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import shard
from tests.harness import cached_state, run_ranks
from tests.unit.test_mamba import _config

S, B, H = 32, 2, 64


def _run(state, sp: bool):
    cfg = _config(tensor_model_parallel_size=comm.group_size(state.tp_group), sequence_parallel=sp)
    mixer = MambaMixer(cfg, state, 1)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    dout = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    if sp:  # this rank's sequence shard
        tp, rank = comm.group_size(state.tp_group), comm.group_rank(state.tp_group)
        x, dout = shard(x, 0, rank, tp), shard(dout, 0, rank, tp)
    x.requires_grad_()
    out = mixer(x)
    out.backward(dout)
    return out.detach(), x.grad, {n: p.grad for n, p in mixer.named_parameters()}, dict(mixer.named_parameters())


def _tp2(sp):
    state = cached_state(tp=2)
    out, dx, grads, params = _run(state, sp)
    return out, dx, grads, {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
                            for n, p in params.items()}, comm.group_rank(state.tp_group)


@pytest.mark.parametrize("sp", [False, True])
def test_mamba_mixer_tp2_equals_one_process(sp):
    want_out, want_dx, want_grads, _ = _run(ParallelState(world_size=1, rank=0), False)
    for out, dx, grads, dims, rank in run_ranks(2, _tp2, sp):
        if sp:
            want_out_r, want_dx_r = shard(want_out, 0, rank, 2), shard(want_dx, 0, rank, 2)
        else:
            want_out_r, want_dx_r = want_out, want_dx
        torch.testing.assert_close(out, want_out_r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx, want_dx_r, rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            want = want_grads[name] if dims[name] is None else shard(want_grads[name], dims[name], rank, 2)
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
