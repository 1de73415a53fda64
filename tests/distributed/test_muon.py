"""--optimizer muon under tensor parallelism (2 gloo ranks) against one process.

A column-parallel (rows split) and a row-parallel (columns split) linear with biases, 3 steps with
clipping, weight decay and Nesterov momentum, the full weights gathered at the end:

* ``--muon-tp-mode duplicated`` (all-gather, orthogonalise the whole matrix) and ``distributed``
  (Gram matrix all-reduced) equal the one-process run (fp32, rtol 1e-5);
* ``blockwise`` (Megatron-LM's default) equals one process that orthogonalises each rank's block on
  its own (the update depends on the TP size: the per-block scale factor and iteration).
"""

import pytest
import torch

from megatron_lite.config import Config
from megatron_lite.optim import build_optimizer
from megatron_lite.optim.muon import newton_schulz, scale_factor
from megatron_lite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import unshard
from tests.distributed.test_optimizer import TPMLP, _data, _loss
from tests.harness import cached_state, run_ranks

STEPS = 3


def _cfg(mode):
    cfg = Config()
    o = cfg.optim
    o.optimizer, o.lr, o.weight_decay, o.clip_grad = "muon", 0.05, 0.1, 0.5
    o.muon_tp_mode, o.muon_use_nesterov, o.muon_fp32_matmul_prec = mode, True, "high"
    return cfg


def _train(state, tp_group, mode):
    model = DistributedDataParallel(TPMLP(tp_group), state)
    opt = build_optimizer(_cfg(mode), [model], state)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *_data(step)).backward()
        finalize_model_grads([model], state)
        opt.step()
    return model.module


def check_tp2(mode):
    state = cached_state(tp=2)
    module = _train(state, state.tp_group, mode)
    out = {}
    for name, p in module.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(p) for _ in range(2)]
            torch.distributed.all_gather(parts, p.detach().contiguous(), group=state.tp_group)
            out[name] = unshard(parts, p.partition_dim)
        else:
            out[name] = p.detach().clone()
    return out


def _per_block(u, info):
    """One process orthogonalising each TP-2 rank's block of a split matrix on its own (``info.dim``)."""
    blocks = [newton_schulz(b.contiguous(), 5) * scale_factor(*b.shape, "spectral") for b in u.chunk(2, dim=info.dim)]
    return torch.cat(blocks, dim=info.dim)


def _reference(blockwise: bool):
    state = ParallelState()
    model = DistributedDataParallel(TPMLP(None), state)
    opt = build_optimizer(_cfg("duplicated"), [model], state)
    if blockwise:
        opt.optimizer.orthogonalize = _per_block
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *_data(step)).backward()
        finalize_model_grads([model], state)
        opt.step()
    return {n: p.detach() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("mode", ["duplicated", "distributed", "blockwise"])
def test_tp2_equals_one_process(mode):
    got = run_ranks(2, check_tp2, mode)
    expected = _reference(blockwise=mode == "blockwise")
    for name, value in expected.items():
        torch.testing.assert_close(got[0][name], value, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
        torch.testing.assert_close(got[1][name], got[0][name], rtol=0, atol=0, msg=f"{mode}: {name} differs between ranks")
    assert not torch.allclose(expected["fc1.weight"], TPMLP(None).fc1.weight, atol=1e-3)  # it moved
