"""Context-parallel core attention equals single-process attention, forward and backward.

Every rank draws the same full q, k, v and output gradient, computes the reference with
``F.scaled_dot_product_attention`` over the whole sequence (autograd gives dq, dk, dv), then runs
:class:`ContextParallelAttention` on its load-balanced share and backpropagates its share of the
output gradient. Its output and q/k/v gradients must equal this rank's share of the reference
(fp32; rtol 1e-5, atol 1e-6: only the summation order differs - the ring merges blocks by
log-sum-exp, the all-gather/all-to-all variants reduce gradients over ranks). Dropout is off here
(different masks than the reference by construction); tests/unit/test_context_split.py checks
that the ring's dropout backward replays its forward masks.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.parallel.context import ContextParallelAttention, split_for_cp
from tests.harness import cached_state, run_ranks

B, D = 2, 8


def _reference(seq, nq, nkv, causal, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(seq, B, n, D, generator=gen) for n in (nq, nkv, nkv))
    dout = torch.randn(seq, B, nq * D, generator=gen)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (qr, kr, vr)), is_causal=causal,
                                         enable_gqa=nq != nkv).permute(2, 0, 1, 3).reshape(seq, B, nq * D)
    out.backward(dout)
    return (q, k, v, dout), (out.detach(), qr.grad, kr.grad, vr.grad)


def check_cp_attention(cp, comm_type, causal, nq, nkv, seq):
    state = cached_state(cp=cp)
    (q, k, v, dout), expected = _reference(seq, nq, nkv, causal)
    mine = lambda t: split_for_cp(t, 0, state.cp_rank, cp)  # noqa: E731
    config = SimpleNamespace(cp_comm_type=comm_type, attention_dropout=0.0, num_attention_heads=nq,
                             num_query_groups=nkv)
    attn = ContextParallelAttention(config, state, layer_number=1)
    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    out = attn(ql, kl, vl, None, causal)
    out.backward(mine(dout))
    for got, want, name in zip((out, ql.grad, kl.grad, vl.grad), expected, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(got, mine(want), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return True


CASES = [  # (comm type, causal, query heads, key/value heads)
    ("p2p", True, 4, 4), ("p2p", False, 4, 4), ("p2p", True, 4, 2), ("p2p", True, 4, 1),
    ("a2a", True, 4, 4), ("a2a", False, 8, 4),
    ("allgather", True, 4, 4), ("allgather", False, 4, 2), ("allgather", True, 4, 1),
]


@pytest.mark.parametrize("comm_type,causal,nq,nkv", CASES)
def test_cp2_equals_full_attention(comm_type, causal, nq, nkv):
    assert all(run_ranks(2, check_cp_attention, 2, comm_type, causal, nq, nkv, 16))


@pytest.mark.parametrize("comm_type,causal,nq,nkv", [
    ("p2p", True, 4, 4), ("p2p", False, 4, 2), ("p2p", True, 8, 2), ("a2a", True, 8, 4), ("allgather", True, 4, 2),
])
def test_cp4_equals_full_attention(comm_type, causal, nq, nkv):
    assert all(run_ranks(4, check_cp_attention, 4, comm_type, causal, nq, nkv, 32))


def check_a2a_refuses_uneven_heads(cp, nq, nkv):
    state = cached_state(cp=cp)
    config = SimpleNamespace(cp_comm_type="a2a", attention_dropout=0.0, num_attention_heads=nq, num_query_groups=nkv)
    with pytest.raises(ValueError, match="a2a needs num-attention-heads .* divisible by"):
        ContextParallelAttention(config, state, layer_number=1)
    return True


def test_a2a_refuses_heads_not_divisible_by_cp():
    assert all(run_ranks(2, check_a2a_refuses_uneven_heads, 2, 3, 3))
    assert all(run_ranks(2, check_a2a_refuses_uneven_heads, 2, 4, 1))  # MQA: one group cannot be split
