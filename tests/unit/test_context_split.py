"""Context-parallel pieces that need no process group: the load-balanced split, the batch split,
and the attention block kernels (log-sum-exp output, backward from the final output/lse, dropout
replay) against PyTorch's attention with autograd (fp64: exact to 1e-10; fp32: 1e-5)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.parallel import ring_attention as ring_attention_module
from megatron_lite.parallel.context import (
    ContextParallelAttention,
    cp_positions,
    get_batch_on_this_cp_rank,
    split_for_cp,
    unsplit_from_cp,
)
from megatron_lite.parallel.ring_attention import _keep_mask, block_backward, block_forward, ring_attention


def test_positions_follow_the_load_balanced_chunks():
    # S=24, cp=3, chunk 4: rank 0 -> 0-3 and 20-23, rank 1 -> 4-7 and 16-19, rank 2 -> 8-15
    assert cp_positions(24, 0, 3).tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert cp_positions(24, 1, 3).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert cp_positions(24, 2, 3).tolist() == list(range(8, 16))
    assert cp_positions(8, 0, 1).tolist() == list(range(8))
    with pytest.raises(ValueError, match="not divisible by 2 x --context-parallel-size 2 .*use a multiple of 4"):
        cp_positions(6, 0, 2)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_unsplit_round_trip(cp):
    x = torch.randn(3, 32, 5)
    parts = [split_for_cp(x, 1, r, cp) for r in range(cp)]
    assert all(p.shape == (3, 32 // cp, 5) for p in parts)
    torch.testing.assert_close(unsplit_from_cp(parts, 1), x, rtol=0, atol=0)
    # every position is held by exactly one rank
    held = torch.cat([cp_positions(32, r, cp) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(32))


def test_batch_split_keeps_global_positions():
    tokens = torch.arange(16).view(1, 16) + 100
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(1, 16), "attention_mask": mask,
             "other": "kept"}
    out = get_batch_on_this_cp_rank(batch, 1, 2)  # rank 1 of 2: chunks 1 and 2 of 4 -> positions 4..11
    assert out["position_ids"].tolist() == [list(range(4, 12))]
    assert out["tokens"].tolist() == [list(range(104, 112))]
    assert out["labels"].tolist() == [list(range(105, 113))]
    assert out["attention_mask"].shape == (1, 1, 8, 16)
    torch.testing.assert_close(out["attention_mask"], mask[:, :, 4:12])
    assert out["other"] == "kept" and batch["tokens"] is tokens  # the input dict is not modified
    assert get_batch_on_this_cp_rank(batch, 0, 1) is batch


def _reference(q, k, v, causal):
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return qr, kr, vr, out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nq,nkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("kernel", ["cpu_flash", "plain"])
def test_block_kernels_return_lse_and_exact_grads(kernel, nq, nkv, causal, dtype, monkeypatch):
    """Split the keys in two blocks, merge by lse, and run each block's backward from the final
    output/lse: the result must be full attention and its gradients."""
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    q, k, v = (torch.randn(2, n, 12, 8, dtype=dtype) for n in (nq, nkv, nkv))
    qr, kr, vr, ref = _reference(q, k, v, causal=False)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    if kernel == "plain":  # the fp32 einsum kernel (GPUs, dropout) instead of the fused CPU one
        monkeypatch.setattr(ring_attention_module, "_use_cpu_flash", lambda q, p: False)
    p = 0.0
    halves = [slice(0, 5), slice(5, None)]
    outs = [block_forward(q, k[:, :, s], v[:, :, s], False, 8 ** -0.5, p, seed=3) for s in halves]
    lse = torch.logaddexp(outs[0][1], outs[1][1])
    out = sum(o * torch.exp(lb - lse).unsqueeze(-1) for o, lb in outs).to(dtype)
    torch.testing.assert_close(out, ref.detach(), **tol)
    grads = [block_backward(dout, q, k[:, :, s], v[:, :, s], out, lse, False, 8 ** -0.5, p, seed=3) for s in halves]
    torch.testing.assert_close(grads[0][0] + grads[1][0], qr.grad, **tol)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 2), kr.grad, **tol)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 2), vr.grad, **tol)
    if causal:  # a square causal block alone
        qr, kr, vr, ref = _reference(q, k, v, causal=True)
        ref.backward(dout)
        o, lb = block_forward(q, k, v, True, 8 ** -0.5, p)
        torch.testing.assert_close(o.to(dtype), ref.detach(), **tol)
        dq, dk, dv = block_backward(dout, q, k, v, o.to(dtype), lb, True, 8 ** -0.5, p)
        for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
            torch.testing.assert_close(got, want, **tol)


def test_ring_dropout_backward_replays_forward_masks():
    """One rank, dropout 0.3: gradients equal autograd through the same masks drawn explicitly."""
    q, k, v = (torch.randn(2, n, 8, 4, dtype=torch.float64) for n in (4, 2, 2))
    p, seed = 0.3, 77
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(qr, kr, vr, None, True, 0.5, p, seed)
    dout = torch.randn_like(out)
    out.backward(dout)
    # reference: softmax, the kernel's keep-mask for this seed, dropout scaling, GQA by repeating heads
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    scores = qe @ ke.repeat_interleave(2, 1).transpose(-1, -2) * 0.5
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    keep = _keep_mask((2, 2, 2, 8, 8), p, seed, q.device).reshape(2, 4, 8, 8)
    ref = (scores.softmax(-1) * keep / (1 - p)) @ ve.repeat_interleave(2, 1)
    ref.backward(dout)
    assert 0 < keep.float().mean() < 1
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=1e-10, atol=1e-10)
    for got, want in ((qr.grad, qe.grad), (kr.grad, ke.grad), (vr.grad, ve.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_ring_refuses_odd_length_and_uneven_groups():
    q = torch.randn(1, 4, 7, 4)
    with pytest.raises(ValueError, match="even local sequence length"):
        ring_attention(q, q, q, None, True, 0.5)
    q = torch.randn(1, 4, 8, 4)
    with pytest.raises(ValueError, match="4 query heads are not divisible by 3 key/value heads"):
        ring_attention(q, torch.randn(1, 3, 8, 4), torch.randn(1, 3, 8, 4), None, True, 0.5)


def _state(cp, tp=1):
    return SimpleNamespace(cp_group=None, cp_size=cp, cp_rank=0, tp_size=tp, rng_tracker=None)


def test_module_refuses_bad_settings():
    cfg = SimpleNamespace(cp_comm_type="a2a", attention_dropout=0.0, num_attention_heads=6, num_query_groups=2)
    with pytest.raises(ValueError, match="a2a needs --num-attention-heads 6 and --num-query-groups 2 .* divisible by --tensor-model-parallel-size 2 x --context-parallel-size 2 .*use --cp-comm-type p2p"):
        ContextParallelAttention(cfg, _state(cp=2, tp=2), 1)
    cfg.cp_comm_type = "a2a+ring"
    with pytest.raises(ValueError, match="is not one of p2p, a2a, allgather, a2a\\+p2p"):
        ContextParallelAttention(cfg, _state(cp=2), 1)
    cfg.cp_comm_type = "a2a+p2p"  # a state built without the sub-groups
    with pytest.raises(ValueError, match="a2a\\+p2p needs --hierarchical-context-parallel-sizes A B"):
        ContextParallelAttention(cfg, _state(cp=2), 1)
    with pytest.raises(ValueError, match="a2a\\+p2p needs --num-attention-heads 6 and --num-query-groups 2 .* divisible by "
                                         "--tensor-model-parallel-size 1 x the all-to-all size 4 "
                                         "\\(the first of --hierarchical-context-parallel-sizes\\)"):
        ContextParallelAttention(cfg, SimpleNamespace(**vars(_state(cp=8)), hcp_sizes=(4, 2)), 1)
    cfg.cp_comm_type = "p2p"
    attn = ContextParallelAttention(cfg, _state(cp=1), 1)
    q = torch.randn(8, 1, 6, 4)
    with pytest.raises(ValueError, match="causal mask or document ids, not a dense"):
        attn(q, q[:, :, :2], q[:, :, :2], torch.zeros(1, 1, 8, 8, dtype=torch.bool), True)


@pytest.mark.parametrize("comm_type", ["p2p", "a2a", "allgather"])
def test_module_on_one_rank_is_plain_attention(comm_type):
    cfg = SimpleNamespace(cp_comm_type=comm_type, attention_dropout=0.0, num_attention_heads=4, num_query_groups=2)
    attn = ContextParallelAttention(cfg, _state(cp=1), 1)
    q, k, v = (torch.randn(8, 2, n, 4) for n in (4, 2, 2))
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(attn(q, k, v, None, True), ref.permute(2, 0, 1, 3).reshape(8, 2, 16))


def test_transformer_config_checks_context_parallel():
    from megatron_lite.errors import ConfigError
    from megatron_lite.models.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16)
    TransformerConfig(**base, context_parallel_size=4)  # 16 = 2 x 4 chunks of 2
    with pytest.raises(ConfigError, match="--seq-length 12 divisible by 2 x cp = 8"):
        TransformerConfig(**dict(base, seq_length=12), context_parallel_size=4)
    # sequence parallelism cuts a rank's seq / cp tokens over TP: 12 / 2 = 6 over TP 2 runs (Megatron-LM's rule)
    TransformerConfig(**dict(base, seq_length=12), context_parallel_size=2, tensor_model_parallel_size=2,
                      sequence_parallel=True)
    with pytest.raises(ConfigError, match="--seq-length 20 / cp = 10 divisible by --tensor-model-parallel-size 4"):
        TransformerConfig(**dict(base, seq_length=20, num_query_groups=4), context_parallel_size=2,
                          tensor_model_parallel_size=4, sequence_parallel=True)
    with pytest.raises(ConfigError, match="a2a needs --num-query-groups 2 divisible by --tensor-model-parallel-size 1 "
                                          "x --context-parallel-size 4"):
        TransformerConfig(**base, context_parallel_size=4, cp_comm_type="a2a")
    with pytest.raises(ConfigError, match="'ring' is not supported"):
        TransformerConfig(**base, cp_comm_type=["ring"])
    with pytest.raises(ConfigError, match="one value or one per layer \\(2\\), got 3"):
        TransformerConfig(**base, cp_comm_type=["p2p"] * 3)
    with pytest.raises(ConfigError, match="a2a\\+p2p needs --hierarchical-context-parallel-sizes A B with A x B = "
                                          "--context-parallel-size 4"):
        TransformerConfig(**base, context_parallel_size=4, cp_comm_type="a2a+p2p")
    for sizes in ([2, 3], [4], [2, 2, 1], [0, 4]):
        with pytest.raises(ConfigError, match="--hierarchical-context-parallel-sizes .*: give two positive sizes"):
            TransformerConfig(**base, context_parallel_size=4, cp_comm_type="a2a+p2p",
                              hierarchical_context_parallel_sizes=sizes)
    with pytest.raises(ConfigError, match="a2a\\+p2p needs --num-query-groups 2 divisible by --tensor-model-parallel-size 2 "
                                          "x the all-to-all size 2"):
        TransformerConfig(**base, context_parallel_size=4, tensor_model_parallel_size=2, cp_comm_type="a2a+p2p",
                          hierarchical_context_parallel_sizes=[2, 2])
    TransformerConfig(**base, context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])
    per_layer = TransformerConfig(**base, context_parallel_size=2, cp_comm_type=["allgather", "a2a"])
    assert [per_layer.cp_comm_type_of(n) for n in (1, 2)] == ["allgather", "a2a"]
    assert TransformerConfig(**base).cp_comm_type_of(2) == "p2p"
