"""Sliding-window attention (--window-size) under tensor and context parallelism equals one process.

CP: every core-attention kind (p2p ring, a2a, allgather; a2a+p2p at CP4) on its load-balanced share
equals SDPA over the whole sequence under the band written out here (global positions), forward
and q/k/v gradients (fp32, rtol 1e-5 / atol 1e-6), with windows narrower than a CP chunk (a remote
block holds keys some queries cannot see at all) and wider than one (the window crosses chunks),
packed documents and the non-causal band. TP2 (+SP): the whole GPT with a window in every other
layer equals the single-process model (losses, weights, gradients: the harness of
tests/distributed/test_gpt_model.py). CP2 model: per-token losses and gradients equal one process.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.parallel.context import ContextParallelAttention, get_batch_on_this_cp_rank, split_for_cp
from megatron_lite.parallel.state import ParallelState
from tests.distributed.test_context_parallel import packed_document_ids
from tests.distributed.test_gpt_model import check_tp_equals_serial
from tests.harness import cached_state, run_ranks
from tests.model_helpers import build_gpt
from tests.unit.test_gpt_model import VARIANTS, make_batch, make_config

B, D = 2, 8
VARIANTS.setdefault("W", dict(VARIANTS["B"], window_size=[5, 0], window_attn_skip_freq="2"))  # B, window in odd layers


def _band(seq, window, causal):
    pos = torch.arange(seq)
    diff = pos[:, None] - pos[None, :]
    left, right = window
    allowed = torch.ones(seq, seq, dtype=torch.bool)
    if left >= 0:
        allowed &= diff <= left
    if right >= 0:
        allowed &= -diff <= right
    return allowed & (diff >= 0) if causal else allowed


def check_cp_window(cp, comm_type, causal, window, seq, nq=4, nkv=2, documents=False, hcp=None):
    state = cached_state(cp=cp) if hcp is None else cached_state(cp=cp, hcp=hcp)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(seq, B, n, D, generator=gen) for n in (nq, nkv, nkv))
    dout = torch.randn(seq, B, nq * D, generator=gen)
    ids = packed_document_ids(seq) if documents else None
    mask = _band(seq, window, causal).expand(B, 1, seq, seq)
    if ids is not None:
        mask = mask & (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (qr, kr, vr)), attn_mask=mask,
                                         enable_gqa=True).permute(2, 0, 1, 3).reshape(seq, B, nq * D)
    ref.backward(dout)
    config = SimpleNamespace(cp_comm_type=comm_type, attention_dropout=0.0, num_attention_heads=nq,
                             num_query_groups=nkv, softmax_scale=None, window_of=lambda layer: window)
    mine = lambda t: split_for_cp(t, 0, state.cp_rank, cp)  # noqa: E731
    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    out = ContextParallelAttention(config, state, layer_number=1)(
        ql, kl, vl, None if ids is None else split_for_cp(ids, 1, state.cp_rank, cp), causal)
    out.backward(mine(dout))
    for got, want, name in zip((out, ql.grad, kl.grad, vl.grad), (ref, qr.grad, kr.grad, vr.grad),
                               ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(got, mine(want.detach()), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("comm_type,causal,window,documents", [
    ("p2p", True, (2, 0), False), ("p2p", True, (5, 0), True), ("p2p", False, (3, 2), False),
    ("a2a", True, (5, 0), True), ("allgather", True, (2, 0), True), ("allgather", False, (1, 3), False),
])
def test_cp2_window_equals_full_attention(comm_type, causal, window, documents):
    assert all(run_ranks(2, check_cp_window, 2, comm_type, causal, window, 16, documents=documents))


def test_cp4_hierarchical_and_ring_window_equal_full_attention():
    assert all(run_ranks(4, check_cp_window, 4, "a2a+p2p", True, (6, 0), 32, hcp=(2, 2)))
    assert all(run_ranks(4, check_cp_window, 4, "p2p", True, (3, 0), 32, documents=True))


def test_tp2_sp_window_model_equals_single_process():
    assert all(run_ranks(2, check_tp_equals_serial, 2, True, "W"))


def check_cp_model(cp):
    state = cached_state(cp=cp)
    cfg = make_config("W")
    tokens, labels = make_batch(4)
    serial = build_gpt(cfg, ParallelState(world_size=1, rank=0), seed=9)
    loss_ref = serial(tokens, labels=labels)
    loss_ref.sum().backward()
    model = build_gpt(cfg, state, seed=9, context_parallel_size=cp)
    batch = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels}, state.cp_rank, cp)
    loss = model(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"])
    loss.sum().backward()
    torch.testing.assert_close(loss, split_for_cp(loss_ref, 1, state.cp_rank, cp), rtol=1e-5, atol=1e-6)
    ref = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=state.cp_group)  # each CP rank holds the gradient of its tokens
        torch.testing.assert_close(grad, ref[name].grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    return True


def test_cp2_window_model_equals_single_process():
    assert all(run_ranks(2, check_cp_model, 2))


def check_ring_skips_blocks_outside_the_window(cp):
    """A narrow window leaves remote blocks no query can see: the ring does not compute them
    (forward or backward), and the result is still the full attention's (check_cp_window)."""
    from megatron_lite.parallel import ring_attention as ring

    calls = []
    forward, backward = ring.block_forward, ring.block_backward
    ring.block_forward = lambda *a, **kw: calls.append("f") or forward(*a, **kw)
    ring.block_backward = lambda *a, **kw: calls.append("b") or backward(*a, **kw)
    try:
        check_cp_window(cp, "p2p", True, (3, 0), 8 * cp)
    finally:
        ring.block_forward, ring.block_backward = forward, backward
    return calls.count("f"), calls.count("b")


def test_ring_skips_the_blocks_outside_the_window():
    counts = run_ranks(4, check_ring_skips_blocks_outside_the_window, 4)
    assert all(f == b for f, b in counts)
    assert sum(f for f, _ in counts) < 4 * 4  # 4 steps on each of 4 ranks without skipping
