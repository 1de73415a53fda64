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


def packed_document_ids(seq):
    """Document ids ``[B, seq]`` of packed sequences whose boundaries fall inside the CP chunks."""
    rows = []
    for lengths in ([3, 6, 1, 4], [7, 2]):
        ids = [d for d, n in enumerate(lengths) for _ in range(n)]
        rows.append(ids + [len(lengths)] * (seq - len(ids)))  # the rest: one more document (padding)
    return torch.tensor(rows)


def _reference(seq, nq, nkv, causal, seed=0, ids=None, dv=D, scale=None):
    """Full attention (SDPA) and its gradients; with ``ids`` confined to each document (the mask
    written out here: same id, and key position <= query position when causal)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(seq, B, n, d, generator=gen) for n, d in ((nq, D), (nkv, D), (nkv, dv)))
    dout = torch.randn(seq, B, nq * dv, generator=gen)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    mask = None
    if ids is not None:
        mask = (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)
        if causal:
            mask = mask & torch.ones(seq, seq, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (qr, kr, vr)), attn_mask=mask,
                                         is_causal=causal and mask is None, enable_gqa=nq != nkv,
                                         scale=scale).permute(2, 0, 1, 3).reshape(seq, B, nq * dv)
    out.backward(dout)
    return (q, k, v, dout), (out.detach(), qr.grad, kr.grad, vr.grad)


def check_cp_attention(cp, comm_type, causal, nq, nkv, seq, documents=False, dv=D, scale=None, hcp=None):
    state = cached_state(cp=cp) if hcp is None else cached_state(cp=cp, hcp=hcp)
    ids = packed_document_ids(seq) if documents else None
    (q, k, v, dout), expected = _reference(seq, nq, nkv, causal, ids=ids, dv=dv, scale=scale)
    mine = lambda t: split_for_cp(t, 0, state.cp_rank, cp)  # noqa: E731
    config = SimpleNamespace(cp_comm_type=comm_type, attention_dropout=0.0, num_attention_heads=nq,
                             num_query_groups=nkv, softmax_scale=scale)
    attn = ContextParallelAttention(config, state, layer_number=1)
    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    out = attn(ql, kl, vl, None if ids is None else split_for_cp(ids, 1, state.cp_rank, cp), causal)
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


@pytest.mark.parametrize("comm_type,dv,documents", [
    ("p2p", 6, False), ("p2p", 12, False), ("a2a", 6, False), ("allgather", 6, False), ("p2p", 6, True),
    ("allgather", 12, True),
])
def test_cp2_value_head_size_of_its_own(comm_type, dv, documents):
    """MLA's layout: values narrower (or wider) than queries/keys, and the config's softmax scale
    (also with packed documents: the ring's padded CPU kernels take the document mask too)."""
    assert all(run_ranks(2, check_cp_attention, 2, comm_type, True, 4, 4, 16, documents=documents, dv=dv, scale=0.3))


@pytest.mark.parametrize("comm_type,causal,nq,nkv", [
    ("p2p", True, 4, 4), ("p2p", False, 4, 2), ("p2p", True, 8, 2), ("a2a", True, 8, 4), ("allgather", True, 4, 2),
])
def test_cp4_equals_full_attention(comm_type, causal, nq, nkv):
    assert all(run_ranks(4, check_cp_attention, 4, comm_type, causal, nq, nkv, 32))


@pytest.mark.parametrize("cp,comm_type,causal,nq,nkv", [
    (2, "p2p", True, 4, 2), (2, "p2p", False, 4, 4), (2, "a2a", True, 4, 2), (2, "allgather", True, 4, 1),
    (2, "allgather", False, 4, 4), (4, "p2p", True, 4, 2), (4, "a2a", True, 8, 4), (4, "allgather", True, 4, 2),
])
def test_packed_documents_equal_full_attention_under_cp(cp, comm_type, causal, nq, nkv):
    """Document ids as the mask (packed sequences): every CP kind confines attention to each
    document exactly as full attention under the written-out block mask, forward and backward."""
    assert all(run_ranks(cp, check_cp_attention, cp, comm_type, causal, nq, nkv, 8 * cp, True))


@pytest.mark.parametrize("hcp,causal,nq,nkv,documents", [
    ((2, 2), True, 8, 4, False), ((2, 2), False, 4, 2, False), ((2, 2), True, 4, 2, True),
    ((4, 1), True, 4, 4, False), ((1, 4), True, 4, 2, True),
])
def test_hierarchical_cp4_equals_full_attention(hcp, causal, nq, nkv, documents):
    """a2a+p2p at CP 4 as A x B: Ulysses over A consecutive CP ranks, then the ring over B ranks on
    their gathered chunks (which must sit at their true positions for the causal plan), forward and
    backward, with GQA and packed documents; (4, 1) is pure Ulysses, (1, 4) the pure ring."""
    assert all(run_ranks(4, check_cp_attention, 4, "a2a+p2p", causal, nq, nkv, 32, documents, hcp=hcp))


def check_hierarchical_equals_ring(hcp, nq, nkv, seq):
    """a2a+p2p and p2p modules on the same CP4 shares: outputs and q/k/v gradients agree (rtol 1e-5)."""
    results = []
    for comm_type, state in (("p2p", cached_state(cp=4)), ("a2a+p2p", cached_state(cp=4, hcp=hcp))):
        (q, k, v, dout), _ = _reference(seq, nq, nkv, True, seed=3)
        mine = lambda t, s=state: split_for_cp(t, 0, s.cp_rank, 4)  # noqa: E731
        config = SimpleNamespace(cp_comm_type=comm_type, attention_dropout=0.0, num_attention_heads=nq,
                                 num_query_groups=nkv)
        ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
        out = ContextParallelAttention(config, state, layer_number=1)(ql, kl, vl, None, True)
        out.backward(mine(dout))
        results.append((out, ql.grad, kl.grad, vl.grad))
    for ring, hier, name in zip(*results, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(hier, ring, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return True


def test_hierarchical_cp4_equals_ring_cp4():
    assert all(run_ranks(4, check_hierarchical_equals_ring, (2, 2), 4, 2, 32))


def check_a2a_refuses_uneven_heads(cp, nq, nkv):
    state = cached_state(cp=cp)
    config = SimpleNamespace(cp_comm_type="a2a", attention_dropout=0.0, num_attention_heads=nq, num_query_groups=nkv)
    with pytest.raises(ValueError, match="a2a needs --num-attention-heads .* divisible by --tensor-model-parallel-size"):
        ContextParallelAttention(config, state, layer_number=1)
    return True


def test_a2a_refuses_heads_not_divisible_by_cp():
    assert all(run_ranks(2, check_a2a_refuses_uneven_heads, 2, 3, 3))
    assert all(run_ranks(2, check_a2a_refuses_uneven_heads, 2, 4, 1))  # MQA: one group cannot be split


def check_ring_dropout_gradient(cp, dv=D, hcp=None):
    """With dropout the ring's backward must be the derivative of its forward (same masks replayed):
    the directional derivative from the gradients equals a central finite difference (fp64). With
    ``hcp`` the same through a2a+p2p (the ring inside the all-to-alls)."""
    import torch.distributed as dist

    from megatron_lite.parallel.context import hierarchical_attention
    from megatron_lite.parallel.ring_attention import ring_attention

    state = cached_state(cp=cp) if hcp is None else cached_state(cp=cp, hcp=hcp)
    attend = ring_attention

    if hcp is not None:  # [b, n, s, d] in and out, as ring_attention's
        def attend(q, k, v, group, causal, scale, p, seed=0):
            q, k, v = (t.permute(2, 0, 1, 3) for t in (q, k, v))
            out = hierarchical_attention(q, k, v, state.group("cp_a2a"), state.group("cp_ring"), causal, scale, p, seed)
            return out.permute(1, 2, 0, 3)
    gen = torch.Generator().manual_seed(5)
    full = [torch.randn(B, n, 8 * cp, d, dtype=torch.float64, generator=gen)
            for n, d in ((4, D), (2, D), (2, dv), (4, dv), (4, D), (2, D), (2, dv))]
    q, k, v, dout, dq_dir, dk_dir, dv_dir = (split_for_cp(t, 2, state.cp_rank, cp) for t in full)
    seed = 11 + 1000003 * state.cp_rank  # per-rank seeds, as the module draws them

    def total(eps):
        out = attend(q + eps * dq_dir, k + eps * dk_dir, v + eps * dv_dir, state.cp_group, True, 0.35, 0.25, seed)
        value = (out * dout).sum()
        dist.all_reduce(value, group=state.cp_group)
        return value

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    (attend(qr, kr, vr, state.cp_group, True, 0.35, 0.25, seed) * dout).sum().backward()
    analytic = (qr.grad * dq_dir).sum() + (kr.grad * dk_dir).sum() + (vr.grad * dv_dir).sum()
    dist.all_reduce(analytic, group=state.cp_group)
    eps = 1e-6
    numeric = (total(eps) - total(-eps)) / (2 * eps)
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-8)
    # and dropout really dropped something: the result differs from the dropout-free one
    no_drop = attend(q, k, v, state.cp_group, True, 0.35, 0.0)
    assert not torch.allclose(attend(q, k, v, state.cp_group, True, 0.35, 0.25, seed), no_drop)
    return True


@pytest.mark.parametrize("cp, dv, hcp", [(2, D, None), (4, D, None), (2, 6, None), (4, 6, (2, 2))])
def test_ring_dropout_backward_is_the_derivative_of_forward(cp, dv, hcp):
    assert all(run_ranks(cp, check_ring_dropout_gradient, cp, dv, hcp))


def check_bf16_ring(cp):
    """bf16 inputs (the fused CPU kernel in bf16, fp32 merge) stay close to the fp32 reference."""
    state = cached_state(cp=cp)
    (q, k, v, dout), expected = _reference(16, 4, 2, True)
    mine = lambda t: split_for_cp(t, 0, state.cp_rank, cp)  # noqa: E731
    config = SimpleNamespace(cp_comm_type="p2p", attention_dropout=0.0, num_attention_heads=4, num_query_groups=2)
    attn = ContextParallelAttention(config, state, layer_number=1)
    ql, kl, vl = (mine(t).bfloat16().requires_grad_() for t in (q, k, v))
    out = attn(ql, kl, vl, None, True)
    out.backward(mine(dout).bfloat16())
    assert out.dtype == ql.grad.dtype == kl.grad.dtype == torch.bfloat16
    for got, want in zip((out, ql.grad, kl.grad, vl.grad), expected):
        torch.testing.assert_close(got.float(), mine(want), rtol=2e-2, atol=2e-2)
    return True


def test_bf16_ring_is_close_to_fp32_attention():
    assert all(run_ranks(2, check_bf16_ring, 2))


def check_cp_with_tp(comm_type, nq, nkv):
    """tp 2 x cp 2 on 4 ranks: the CP groups are {0, 2} and {1, 3} (not contiguous), each TP rank
    attends its own heads (whole key/value groups) over its CP share of the sequence."""
    state = cached_state(tp=2, cp=2)
    assert state.ranks("cp") == [state.tp_rank, state.tp_rank + 2]
    (q, k, v, dout), expected = _reference(16, nq, nkv, True)
    heads = lambda t, n: t.view(16, B, n, D).chunk(2, 2)[state.tp_rank]  # noqa: E731
    mine = lambda t: split_for_cp(t, 0, state.cp_rank, 2)  # noqa: E731
    config = SimpleNamespace(cp_comm_type=comm_type, attention_dropout=0.0, num_attention_heads=nq, num_query_groups=nkv)
    attn = ContextParallelAttention(config, state, layer_number=1)
    ql, kl, vl = (mine(heads(t, n)).clone().requires_grad_() for t, n in ((q, nq), (k, nkv), (v, nkv)))
    out = attn(ql, kl, vl, None, True)
    out.backward(mine(heads(dout, nq)).reshape(8, B, -1))
    want_out, dq, dk, dv = expected
    torch.testing.assert_close(out, mine(heads(want_out, nq)).reshape(8, B, -1), rtol=1e-5, atol=1e-6)
    for got, want, n in ((ql.grad, dq, nq), (kl.grad, dk, nkv), (vl.grad, dv, nkv)):
        torch.testing.assert_close(got, mine(heads(want, n)), rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("comm_type,nq,nkv", [("p2p", 4, 2), ("a2a", 8, 4), ("allgather", 4, 2)])
def test_cp2_with_tp2_equals_full_attention(comm_type, nq, nkv):
    assert all(run_ranks(4, check_cp_with_tp, comm_type, nq, nkv))


def check_gpt_model_with_cp(cp, comm_type, variant, hcp=None):
    """A GPTModel at CP ``cp`` fed this rank's chunks (no position ids: the model derives the
    global ones) gives the single-process per-token losses of those tokens, and its gradients
    summed over the CP group equal the single-process gradients."""
    import torch.distributed as dist

    from megatron_lite.parallel.state import ParallelState
    from tests.model_helpers import build_gpt
    from tests.unit.test_gpt_model import make_batch, make_config

    state = cached_state(cp=cp) if hcp is None else cached_state(cp=cp, hcp=hcp)
    tokens, labels = make_batch(4)
    serial = build_gpt(make_config(variant), ParallelState(world_size=1, rank=0), seed=9)
    loss_ref = serial(tokens, labels=labels)
    loss_ref.sum().backward()
    cfg = make_config(variant)
    model = build_gpt(cfg, state, seed=9, context_parallel_size=cp, cp_comm_type=comm_type,
                      hierarchical_context_parallel_sizes=list(hcp) if hcp else None)
    assert type(model.decoder.layers[0].self_attention.core_attention).__name__ == "ContextParallelAttention"
    types = [comm_type] if isinstance(comm_type, str) else comm_type
    assert [layer.self_attention.core_attention.comm_type for layer in model.decoder.layers] == types * (2 // len(types))
    mine = lambda t: split_for_cp(t, 1, state.cp_rank, cp)  # noqa: E731
    loss = model(mine(tokens), labels=mine(labels))
    torch.testing.assert_close(loss, mine(loss_ref.detach()), rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    ref = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=state.cp_group)
        torch.testing.assert_close(grad, ref[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("cp,comm_type,variant", [(2, "p2p", "A"), (2, "p2p", "B"), (4, "p2p", "B"),
                                                   (2, "a2a", "B"), (2, "allgather", "A"), (2, "p2p", "P"),
                                                   (2, "allgather", "S"), (2, "p2p", "K")])
def test_gpt_model_with_cp_equals_single_process(cp, comm_type, variant):
    assert all(run_ranks(cp, check_gpt_model_with_cp, cp, comm_type, variant))


def test_gpt_model_with_a2a_p2p_in_some_layers_equals_single_process():
    """Per-layer types: a2a+p2p (2x2) in the first layer, p2p in the second, at CP 4."""
    assert all(run_ranks(4, check_gpt_model_with_cp, 4, ["a2a+p2p", "p2p"], "B", (2, 2)))


def check_dropout_differs_across_cp_ranks(comm_type, hcp=None):
    """Identical inputs on both CP ranks, not causal, dropout 0.5: the tracker's generator is the
    same on both ranks, so only the CP-rank offset of the seed makes their masks differ; the same
    call repeated from the same tracker state repeats exactly."""
    import torch.distributed as dist

    from megatron_lite.parallel.random import model_parallel_seed

    state = cached_state(cp=2) if hcp is None else cached_state(cp=2, hcp=hcp)
    model_parallel_seed(21, state)  # the same tracker seed on both CP ranks (it depends on the TP rank only)
    config = SimpleNamespace(cp_comm_type=comm_type, attention_dropout=0.5, num_attention_heads=4, num_query_groups=4)
    attn = ContextParallelAttention(config, state, layer_number=1)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(8, 1, 4, D, generator=gen)
    by_heads = comm_type == "a2a" or hcp == (2, 1)  # the CP ranks attend different heads of the same tokens
    if by_heads:  # the same values in both head groups, so only the masks can differ
        q = q[:, :, :2].repeat(1, 1, 2, 1)
    saved = state.rng_tracker.get_states()
    outs = []
    for _ in range(2):
        state.rng_tracker.set_states(saved)
        outs.append(attn(q, q, q, None, False))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    other = torch.empty_like(outs[0])
    dist.all_gather([torch.empty_like(other), other] if state.cp_rank == 0 else [other, torch.empty_like(other)],
                    outs[0], group=state.cp_group)
    return bool(torch.equal(outs[0].reshape(8, 1, 2, -1)[:, :, 0], outs[0].reshape(8, 1, 2, -1)[:, :, 1])
                if by_heads else torch.equal(other, outs[0]))


@pytest.mark.parametrize("comm_type,hcp", [("allgather", None), ("a2a", None), ("p2p", None), ("a2a+p2p", (2, 1)),
                                           ("a2a+p2p", (1, 2))])
def test_attention_dropout_masks_differ_across_cp_ranks(comm_type, hcp):
    assert not any(run_ranks(2, check_dropout_differs_across_cp_ranks, comm_type, hcp))


def _cp_loss_gradient():
    import pretrain_gpt

    state = cached_state(cp=2)
    g = torch.Generator().manual_seed(0)
    losses, mask = torch.rand(2, 8, generator=g), torch.ones(2, 8)
    mask[0, :3] = 0  # the ranks hold different numbers of trained tokens
    local = split_for_cp(losses, 1, state.cp_rank, 2).requires_grad_()
    loss, reported = pretrain_gpt.loss_func(split_for_cp(mask, 1, state.cp_rank, 2), local, cp_group=state.cp_group)
    loss.backward()
    return local.grad, reported["lm loss"], losses, mask


def test_gpt_loss_under_cp_backpropagates_the_global_token_mean():
    """pretrain_gpt.loss_func at CP 2: the reported loss is the mean over both ranks' tokens, and each
    rank's gradient, after the data-parallel average over DP x CP divides it by cp, is that of the
    global mean (mask / global count), not of its own shard's mean (rtol 1e-6)."""
    for rank, (grad, shown, losses, mask) in enumerate(run_ranks(2, _cp_loss_gradient)):
        torch.testing.assert_close(shown, (losses * mask).sum() / mask.sum(), rtol=1e-6, atol=0)
        torch.testing.assert_close(grad / 2, split_for_cp(mask / mask.sum(), 1, rank, 2), rtol=1e-6, atol=0)
