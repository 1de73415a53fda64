"""Attention confined to packed documents (document ids as the mask), checked at the token level.

The references are written out here: SDPA under the block mask "same id and key position <=
query position", and each document run through the model on its own. fp32; only the summation
order differs (rtol 1e-5 / atol 1e-6).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.models.attention import DotProductAttention
from megatron_lite.parallel import ring_attention as ring_attention_module
from megatron_lite.parallel.document_mask import cu_seqlens, document_allowed
from megatron_lite.parallel.ring_attention import block_backward, block_forward, ring_attention
from megatron_lite.parallel.state import ParallelState
from tests.model_helpers import build_gpt
from tests.unit.test_gpt_model import make_config

TOL = dict(rtol=1e-5, atol=1e-6)
IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])


def _block_mask(ids, causal=True):
    s = ids.shape[1]
    mask = (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)
    return mask & torch.ones(s, s, dtype=torch.bool).tril() if causal else mask


def _sdpa(q, k, v, mask):
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return (qr, kr, vr), out


def test_cu_seqlens_cut_the_flat_stream_at_documents_and_samples():
    bounds, longest = cu_seqlens(IDS)
    assert bounds.tolist() == [0, 3, 5, 10, 12, 19, 24] and bounds.dtype == torch.int32 and longest == 7


@pytest.mark.parametrize("kernel", ["cpu_flash", "plain"])
def test_block_kernels_with_documents_merge_to_the_block_mask(kernel, monkeypatch):
    """Keys in two blocks: rows a document mask empties in one block (lse -inf) must add nothing,
    and each block's backward from the final output/lse gives the exact gradients."""
    if kernel == "plain":
        monkeypatch.setattr(ring_attention_module, "_use_cpu_flash", lambda q, p: False)
    q, k, v = (torch.randn(2, n, 12, 8) for n in (4, 2, 2))
    (qr, kr, vr), ref = _sdpa(q, k, v, _block_mask(IDS))
    dout = torch.randn_like(ref)
    ref.backward(dout)
    allowed = document_allowed(IDS, IDS) & torch.ones(12, 12, dtype=torch.bool).tril()
    halves = [slice(0, 6), slice(6, None)]
    outs = [block_forward(q, k[:, :, s], v[:, :, s], False, 8 ** -0.5, allowed=allowed[..., s]) for s in halves]
    assert torch.isinf(outs[1][1]).any()  # early queries see nothing in the late keys
    lse = torch.logaddexp(outs[0][1], outs[1][1])
    out = sum(o * torch.exp(lb - lse).unsqueeze(-1) for o, lb in outs)
    torch.testing.assert_close(out, ref.detach(), **TOL)
    grads = [block_backward(dout, q, k[:, :, s], v[:, :, s], out, lse, False, 8 ** -0.5, allowed=allowed[..., s])
             for s in halves]
    torch.testing.assert_close(grads[0][0] + grads[1][0], qr.grad, **TOL)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 2), kr.grad, **TOL)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 2), vr.grad, **TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_one_rank_ring_and_sdpa_path_take_document_ids(causal):
    q, k, v = (torch.randn(2, n, 12, 8) for n in (4, 2, 2))
    (qr, kr, vr), ref = _sdpa(q, k, v, _block_mask(IDS, causal))
    ref.sum().backward()
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(qa, ka, va, None, causal, 8 ** -0.5, document_ids=IDS)
    out.sum().backward()
    torch.testing.assert_close(out, ref.detach(), **TOL)
    for got, want in ((qa.grad, qr.grad), (ka.grad, kr.grad), (va.grad, vr.grad)):
        torch.testing.assert_close(got, want, **TOL)
    attn = _attention()
    sbhd = [t.permute(2, 0, 1, 3) for t in (q, k, v)]
    torch.testing.assert_close(attn(*sbhd, IDS, causal), ref.detach().permute(2, 0, 1, 3).reshape(12, 2, 32), **TOL)


def _attention():
    from megatron_lite.models.transformer_config import TransformerConfig

    config = TransformerConfig.from_model(make_config("B", kv_channels=8), tensor_model_parallel_size=1)
    return DotProductAttention(config, ParallelState(), layer_number=1)


def test_flash_path_passes_documents_as_cu_seqlens():
    """The flash-attn path (GPU only) with a stand-in variable-length kernel that attends within
    each [cu[i], cu[i+1]) range of the flat stream: it must give the SDPA path's result."""

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal):
        assert torch.equal(cu_q, cu_k) and max_q == max_k == 7
        out = torch.empty_like(q)
        for lo, hi in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            part = [t[lo:hi].transpose(0, 1) for t in (q, k, v)]  # [heads, n, d]
            out[lo:hi] = F.scaled_dot_product_attention(*part, is_causal=causal, scale=softmax_scale,
                                                        enable_gqa=True).transpose(0, 1)
        return out

    attn = _attention()
    attn.flash = (None, varlen)
    q, k, v = (torch.randn(12, 2, n, 8) for n in (8, 4, 4))
    expected = attn._attend(q, k, v, IDS, True, 0.0)  # q is on the CPU: the SDPA path
    torch.testing.assert_close(attn._flash_documents(q, k, v, IDS, True, 0.0), expected, **TOL)


@pytest.mark.parametrize("variant", ["A", "B"])
def test_packed_documents_equal_each_document_alone(variant):
    """GPT with document ids and positions restarting per document: every token's loss is the
    loss of the same token when its document runs alone."""
    model = build_gpt(make_config(variant), ParallelState(), seed=5)
    lengths = [5, 3, 8]
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, 100, (1, 16), generator=g) for _ in range(2))
    ids = torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)]])
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = model(tokens, positions, ids, labels=labels)
    start = 0
    for n in lengths:
        alone = model(tokens[:, start:start + n], labels=labels[:, start:start + n])
        torch.testing.assert_close(packed[:, start:start + n], alone, **TOL)
        start += n
    assert not torch.allclose(model(tokens, labels=labels)[:, 5:], packed[:, 5:])  # plain causal differs
