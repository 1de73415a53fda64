"""Attention sinks (--softmax-type learnable) under context and tensor parallelism equal one process.

CP2: p2p (ring), a2a (Ulysses) and allgather core attention on their load-balanced shares equal the
formula over the whole sequence (tests/unit/test_attention_sink.py), with packed documents and a
sliding window on the ring: output and q/k/v gradients, and the sinks' gradient summed over the CP
ranks (each holds the gradient of its own rows, or of its head group under a2a), fp32 rtol 1e-5 /
atol 1e-6, also through the block kernels' plain path (GPUs, dropout, fp16) with a2a's and
allgather's masks without documents. CP4 a2a+p2p: the same. TP2 + SP: the whole GPT with sinks equals the single-process model
(losses, weights, gradients; tests/distributed/test_gpt_model.py's harness).
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_lite.parallel.context import ContextParallelAttention, split_for_cp
from tests.distributed.test_context_parallel import packed_document_ids
from tests.distributed.test_gpt_model import check_tp_equals_serial
from tests.distributed.test_sliding_window_parallel import _band
from tests.harness import cached_state, run_ranks
from tests.unit.test_attention_sink import sink_reference
from tests.unit.test_gpt_model import VARIANTS

B, D, NQ, NKV = 2, 8, 4, 2
SINKS = torch.tensor([-1.0, 0.5, 2.0, 0.0])
VARIANTS.setdefault("SINK", dict(VARIANTS["B"], softmax_type="learnable"))


def check_cp_sink(state, cp, comm_type, window, seq, documents):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(seq, B, n, D, generator=gen) for n in (NQ, NKV, NKV))
    dout = torch.randn(seq, B, NQ * D, generator=gen)
    ids = packed_document_ids(seq) if documents else None
    allowed = _band(seq, window or (-1, 0), True).expand(B, 1, seq, seq)
    if ids is not None:
        allowed = allowed & (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)
    qr, kr, vr, sr = (t.clone().requires_grad_() for t in (q, k, v, SINKS))
    ref = sink_reference(qr, kr, vr, sr, allowed)
    ref.backward(dout)
    config = SimpleNamespace(cp_comm_type=comm_type, attention_dropout=0.0, num_attention_heads=NQ,
                             num_query_groups=NKV, softmax_scale=None, window_of=lambda layer: window,
                             softmax_type="learnable")
    attn = ContextParallelAttention(config, state, layer_number=1)
    with torch.no_grad():
        attn.softmax_offset.copy_(SINKS)
    mine = lambda t: split_for_cp(t, 0, state.cp_rank, cp)  # noqa: E731
    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    out = attn(ql, kl, vl, None if ids is None else split_for_cp(ids, 1, state.cp_rank, cp))
    out.backward(mine(dout))
    for got, want, name in zip((out, ql.grad, kl.grad, vl.grad), (ref, qr.grad, kr.grad, vr.grad),
                               ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(got, mine(want.detach()), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{comm_type} {n}: {m}")
    dsink = attn.softmax_offset.grad.clone()
    dist.all_reduce(dsink, group=state.cp_group)
    torch.testing.assert_close(dsink, sr.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{comm_type} dsink: {m}")


def check_cp2_every_type():
    state = cached_state(cp=2)
    for comm_type, window, documents in (("p2p", None, True), ("p2p", (5, 0), False), ("a2a", (3, 0), True),
                                         ("allgather", None, True)):
        check_cp_sink(state, 2, comm_type, window, 16, documents)
    return True


def test_cp2_ring_ulysses_allgather_equal_the_formula():
    assert all(run_ranks(2, check_cp2_every_type))


def check_cp2_plain_kernel():
    """The block kernels' plain path (GPUs; CPU with attention dropout or fp16) took a2a's window and
    allgather's causal mask in their 2-D form and stopped with a shape error; the flash path took them."""
    from megatron_lite.parallel import ring_attention

    state, flash = cached_state(cp=2), ring_attention._use_cpu_flash
    ring_attention._use_cpu_flash = lambda q, dropout_p: False
    try:
        for comm_type, window in (("a2a", (3, 0)), ("allgather", None), ("allgather", (5, 0)), ("p2p", (5, 0))):
            check_cp_sink(state, 2, comm_type, window, 16, False)
    finally:
        ring_attention._use_cpu_flash = flash
    return True


def test_cp2_plain_kernel_takes_every_mask_form():
    assert all(run_ranks(2, check_cp2_plain_kernel))


def check_cp4_hierarchical():
    check_cp_sink(cached_state(cp=4, hcp=(2, 2)), 4, "a2a+p2p", (6, 0), 32, True)
    return True


def test_cp4_hierarchical_equals_the_formula():
    assert all(run_ranks(4, check_cp4_hierarchical))


def test_tp2_sp_sink_model_equals_single_process():
    assert len(run_ranks(2, check_tp_equals_serial, 2, True, "SINK")) == 2  # each rank asserts equality
