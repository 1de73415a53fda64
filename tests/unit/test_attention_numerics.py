"""--attention-softmax-in-fp32 and --apply-query-key-layer-scaling: the unfused attention's numerics.

The fused kernels (SDPA, flash-attn, the CPU core attention) accumulate the scores and soft-max them in
fp32 whatever the flags say; these flags change the explicit path of --no-masked-softmax-fusion, whose
softmax otherwise runs in the inputs' 16-bit dtype.
"""

import math

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.models import TransformerConfig
from megatron_lite.models.attention import DotProductAttention, unfused_attention
from megatron_lite.parallel.state import ParallelState
from tests.model_helpers import FUSION_MODEL


def _attention(dtype, layer_number=1, **flags):
    config = TransformerConfig(**{**FUSION_MODEL, "attention_dropout": 0.0, "params_dtype": dtype, **flags})
    return DotProductAttention(config, ParallelState(), layer_number)


def _qkv(dtype, s=12, b=2, n=4, d=8, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, b, n, d, generator=g) * scale).to(dtype) for _ in range(3)]


def _run(attention, q, k, v):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, None, True)
    (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _softmax_dtypes(monkeypatch, attention, q, k, v):
    seen, real = [], torch.softmax

    def spy(x, *args, **kwargs):
        seen.append(x.dtype)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "softmax", spy)
    out = attention(q, k, v, None, True)
    return seen, out.dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unfused_softmax_dtype_follows_the_flag(monkeypatch, dtype):
    """Before: the unfused softmax ran in the inputs' 16-bit dtype; with the flag (or query-key layer scaling,
    which sets it) it runs in fp32, and the output keeps the inputs' dtype."""
    q, k, v = _qkv(dtype)
    for flags, expected in (({}, dtype), ({"attention_softmax_in_fp32": True}, torch.float32),
                            ({"apply_query_key_layer_scaling": True, "attention_softmax_in_fp32": True},
                             torch.float32)):
        seen, out_dtype = _softmax_dtypes(monkeypatch, _attention(dtype, masked_softmax_fusion=False, **flags), q, k, v)
        assert seen == [expected], (flags, seen)
        assert out_dtype == dtype


def test_cli_layer_scaling_sets_softmax_in_fp32():
    """Megatron's rule: --apply-query-key-layer-scaling turns --attention-softmax-in-fp32 on."""
    base = ["--mock-data", "--vocab-size", "64", "--fp16", "--no-masked-softmax-fusion"]
    config = TransformerConfig.from_config(parse_args(base + ["--apply-query-key-layer-scaling"], world_size=1))
    assert config.apply_query_key_layer_scaling and config.attention_softmax_in_fp32
    config = TransformerConfig.from_config(parse_args(base + ["--attention-softmax-in-fp32"], world_size=1))
    assert config.attention_softmax_in_fp32 and not config.apply_query_key_layer_scaling
    assert not TransformerConfig.from_config(parse_args(base, world_size=1)).attention_softmax_in_fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unfused_fp32_softmax_equals_fused(dtype):
    """With the flag the explicit path computes what the fused one does: output and q/k/v gradients
    within the 16-bit dtype's rounding of the fused (SDPA / CPU kernel) results."""
    q, k, v = _qkv(dtype, scale=2.0)
    out, grads = _run(_attention(dtype, masked_softmax_fusion=False, attention_softmax_in_fp32=True), q, k, v)
    ref, ref_grads = _run(_attention(dtype), q, k, v)
    tol = 1e-2 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol * r.float().abs().max().item())


def test_layer_scaling_is_exact_outside_fp16():
    """fp32 and bf16 (Megatron scales fp16 only): a scaled layer 5 gives the unscaled layer's bits."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = _qkv(dtype)
        flags = dict(masked_softmax_fusion=False, attention_softmax_in_fp32=True)
        out, grads = _run(_attention(dtype, 5, apply_query_key_layer_scaling=True, **flags), q, k, v)
        ref, ref_grads = _run(_attention(dtype, 5, **flags), q, k, v)
        assert torch.equal(out, ref)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_layer_scaling_fp16_equals_unscaled():
    """fp16, layer 6: scores divided by 6 in the product and multiplied back in the fp32 softmax equal
    the unscaled attention within fp16 rounding (forward and gradients)."""
    q, k, v = _qkv(torch.float16, scale=2.0)
    flags = dict(masked_softmax_fusion=False, attention_softmax_in_fp32=True)
    out, grads = _run(_attention(torch.float16, 6, apply_query_key_layer_scaling=True, **flags), q, k, v)
    ref, ref_grads = _run(_attention(torch.float16, 6, **flags), q, k, v)
    assert not torch.equal(out, ref)  # the scaled path really ran
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=1e-2, atol=1e-2 * r.float().abs().max().item())


def test_layer_scaling_keeps_fp16_scores_finite():
    """Scores of about 1e5 overflow fp16 (inf, then NaN out of the softmax); divided by the layer number
    (8) they fit, and the fp32 softmax gives the fp32 attention's result."""
    b, n, s, d = 1, 2, 6, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, n, s, d, generator=g) for _ in range(3))
    q = q / q.norm(dim=-1, keepdim=True) * 1000
    k = q.roll(1, dims=2) * 0.4 + k / k.norm(dim=-1, keepdim=True) * 600  # q.k up to ~4e5: scaled by 1/4, 1e5
    scale = 1 / math.sqrt(d)
    ref = unfused_attention(q, k, v, None, True, 0.0, scale)
    h = [t.half() for t in (q, k, v)]
    plain = unfused_attention(*h, None, True, 0.0, scale, softmax_in_fp32=True)
    scaled = unfused_attention(*h, None, True, 0.0, scale, softmax_in_fp32=True, coeff=8)
    assert not torch.isfinite(plain).all()
    assert torch.isfinite(scaled).all()
    torch.testing.assert_close(scaled.float(), ref, rtol=1e-2, atol=2e-2)


def test_layer_scaling_needs_the_fp32_softmax():
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="softmax_in_fp32"):
        unfused_attention(q, k, v, None, True, 0.0, 0.3, coeff=2)
