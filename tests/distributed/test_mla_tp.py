"""Multi-latent attention at TP 2 without sequence parallelism against the one-process layer.

The shared rotary key is computed by the replicated down projection on every TP rank and read by
every rank's heads: its gradient must be summed over TP (``copy_to_tp``), or the replicated weight
and the layer's input would get only this rank's heads' share. Output, input gradient and the
replicated down projection's gradient equal the one-process ones on every rank (rtol 1e-5).
"""

import torch

from megatron_lite.models.mla import MLASelfAttention
from megatron_lite.models.yarn import rotary_tables
from megatron_lite.parallel.state import ParallelState
from tests.harness import cached_state, run_ranks
from tests.unit.test_mla import B, H, S, _positions, make_config


def _run(state):
    cfg = make_config("plain")
    mla = MLASelfAttention(cfg, state, 1)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
    dout = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    out = mla(x, rotary=rotary_tables(cfg, _positions(0, S)))
    out.backward(dout)
    return out.detach(), x.grad, mla.linear_kv_down_proj.weight.grad


def _tp2():
    return _run(cached_state(tp=2))


def test_mla_tp2_equals_one_process_with_the_rotary_key_gradient_summed():
    want = _run(ParallelState(world_size=1, rank=0))
    for got in run_ranks(2, _tp2):
        for name, a, b in zip(("output", "input grad", "kv down-projection grad"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
