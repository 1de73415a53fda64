"""cpu_core_attention (the CPU core attention with dropout) against references, forward and backward:

- without dropout it equals PyTorch's scaled_dot_product_attention (causal, causal with a longer
  key/value sequence, grouped-query, a boolean mask with fully masked rows, MLA's value head size);
- with dropout it equals the explicit formula ``softmax(q k^T s + mask) * keep / (1 - p) @ v`` with
  the keep mask drawn from the same generator state (``keep_mask``, one draw per query block),
  and drops about ``p``;
- both in one block and with causal attention cut into query blocks;
- 16-bit inputs give 16-bit outputs within that precision of the fp32 result, computed in fp32 or
  (where the CPU has 16-bit units) in 16 bits;
- DotProductAttention uses it for CPU training with dropout, and selective recomputation replays
  the same mask.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.device import cpu_has_native
from megatron_lite.fusions.dropout import keep_mask
from megatron_lite.models import cpu_attention
from megatron_lite.models.cpu_attention import (
    _CoreAttention,
    compute_dtype,
    cpu_core_attention,
    query_blocks,
)

SCALE = 0.3


def _inputs(b=2, nq=4, nkv=4, sq=8, sk=8, d=6, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, sq, d, generator=g)
    k = torch.randn(b, nkv, sk, d, generator=g)
    v = torch.randn(b, nkv, sk, dv, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


def _run(fn, q, k, v, seed=5):
    torch.manual_seed(seed)
    out = fn(q, k, v)
    out.backward(torch.cos(torch.arange(out.numel())).view_as(out).to(out.dtype))
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach(), grads


def _assert_close(a, b, tol):
    (out_a, grads_a), (out_b, grads_b) = a, b
    for x, y in zip([out_a, *grads_a], [out_b, *grads_b]):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def _sdpa(masked, causal):
    def fn(q, k, v):
        allowed = None if masked is None else ~masked
        if causal and k.shape[2] != q.shape[2]:
            allowed = ~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(k.shape[2] - q.shape[2] + 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=causal and allowed is None,
                                              scale=SCALE, enable_gqa=q.shape[1] != k.shape[1])
    return fn


def _padding_mask(b, sq, sk):
    """True = masked out; batch 1's last two query rows see nothing (padding)."""
    masked = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    masked[1, :, :, -3:] = True
    masked[1, :, -2:, :] = True
    return masked


CASES = {
    "causal": (dict(), None, True),
    "causal, longer keys": (dict(sq=5, sk=8), None, True),
    "grouped query": (dict(nq=6, nkv=2), None, True),
    "mask, empty rows": (dict(), _padding_mask(2, 8, 8), False),
    "mask per head, grouped": (dict(nq=4, nkv=2), torch.rand(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)) < 0.3, False),
    "value head size differs": (dict(d=10, dv=6), None, True),
}


@pytest.fixture(params=["one block", "query blocks"])
def blocks(request, monkeypatch):
    """Causal attention in one block, or cut into query blocks (as long sequences are: 2 rows each here)."""
    if request.param == "query blocks":
        monkeypatch.setattr(cpu_attention, "BLOCK_ROWS", 2)
    return request.param


def test_query_blocks_cover_the_causal_triangle(monkeypatch):
    monkeypatch.setattr(cpu_attention, "BLOCK_ROWS", 2)
    assert query_blocks(8, 8, True) == [(0, 2, 2), (2, 4, 4), (4, 6, 6), (6, 8, 8)]
    assert query_blocks(5, 8, True) == [(0, 2, 5), (2, 5, 8)]  # bottom-right aligned: query 0 sees keys 0..3
    assert query_blocks(8, 8, False) == [(0, 8, 8)]
    assert query_blocks(3, 8, True) == [(0, 3, 8)]


@pytest.mark.parametrize("case", list(CASES))
def test_without_dropout_equals_sdpa(case, blocks):
    shape, masked, causal = CASES[case]
    q, k, v = _inputs(**shape)
    ours = _run(lambda q, k, v: cpu_core_attention(q, k, v, masked, causal, 0.0, SCALE), q, k, v)
    _assert_close(ours, _run(_sdpa(masked, causal), q, k, v), 1e-6)
    if masked is not None:
        assert torch.isfinite(ours[0]).all()


def _formula(masked, causal, p):
    """The explicit formula; the keep mask is drawn as cpu_core_attention draws it (same shape, order)."""
    def fn(q, k, v):
        b, nq, sq, _ = q.shape
        nkv, sk = k.shape[1], k.shape[2]
        group = nq // nkv
        keep = torch.zeros(b * nkv, group, sq, sk, dtype=torch.bool)
        for lo, hi, kend in query_blocks(sq, sk, causal and masked is None):  # one draw per block, in order
            keep[:, :, lo:hi, :kend] = keep_mask((b * nkv, group * (hi - lo), kend), p).view(b * nkv, group, hi - lo, kend)
        keep = keep.view(b, nq, sq, sk)
        k, v = (t.repeat_interleave(nq // nkv, dim=1) for t in (k, v))
        scores = q @ k.transpose(-2, -1) * SCALE
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        elif causal:
            scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return (probs * keep / (1 - p)) @ v
    return fn


@pytest.mark.parametrize("case", list(CASES))
def test_with_dropout_equals_the_formula_with_the_same_draw(case, blocks):
    shape, masked, causal = CASES[case]
    q, k, v = _inputs(**shape)
    ours = _run(lambda q, k, v: cpu_core_attention(q, k, v, masked, causal, 0.25, SCALE), q, k, v)
    _assert_close(ours, _run(_formula(masked, causal, 0.25), q, k, v), 1e-5)
    no_dropout = _run(lambda q, k, v: cpu_core_attention(q, k, v, masked, causal, 0.0, SCALE), q, k, v)
    assert not torch.allclose(ours[0], no_dropout[0])  # something was dropped


def test_drops_the_asked_fraction():
    """Equal scores over n keys and v = 1: a row's output is (kept keys / n) / (1 - p)."""
    n, p = 4096, 0.1
    q = torch.zeros(1, 1, 64, 4)
    k = torch.zeros(1, 1, n, 4)
    v = torch.ones(1, 1, n, 1)
    torch.manual_seed(0)
    out = cpu_core_attention(q, k, v, None, False, p, 1.0)
    kept = (out * (1 - p)).mean().item()
    assert abs(kept - (1 - p)) < 3e-3  # 262144 draws: the standard error is 6e-4


@pytest.mark.parametrize("inner", ["fp32", "16-bit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs(dtype, inner):
    """Computed in fp32 (a CPU without 16-bit units) or in the inputs' dtype (one with them: forced here)."""
    compute = torch.float32 if inner == "fp32" else dtype
    q, k, v = _inputs(nq=4, nkv=2)
    full = _run(lambda q, k, v: cpu_core_attention(q, k, v, None, True, 0.2, SCALE), q, k, v)
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    half = _run(lambda q, k, v: _CoreAttention.apply(q, k, v, None, True, 0.2, SCALE, compute, None), *low)
    assert half[0].dtype == dtype and all(g.dtype == dtype for g in half[1])
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype] * (1 if inner == "fp32" else 2)
    _assert_close((half[0].float(), [g.float() for g in half[1]]), full, tol)


def test_computes_in_16_bit_only_where_the_cpu_has_it():
    assert compute_dtype(torch.float32) == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        assert compute_dtype(dtype) == (dtype if cpu_has_native(dtype) else torch.float32)


def _layer_grads(recompute, monkeypatch, calls):
    from megatron_lite.config import ModelConfig
    from megatron_lite.models import attention
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.parallel.state import ParallelState
    from tests.model_helpers import build_gpt

    def counted(*args):
        calls.append(1)
        return cpu_core_attention(*args)

    monkeypatch.setattr(attention, "cpu_core_attention", counted)
    state = ParallelState()
    model_parallel_seed(3, state)
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, max_position_embeddings=8,
                      vocab_size=32, attention_dropout=0.3, hidden_dropout=0.0)
    kw = {"recompute_granularity": recompute} if recompute else {}
    model = build_gpt(cfg, state, seed=1, **kw)
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    model.decoder(x).square().sum().backward()
    return [x.grad] + [p.grad for p in model.decoder.parameters()]


def test_training_layers_use_it_and_selective_recompute_replays_the_mask(monkeypatch):
    plain_calls, recompute_calls = [], []
    plain = _layer_grads(None, monkeypatch, plain_calls)
    replayed = _layer_grads("selective", monkeypatch, recompute_calls)
    assert len(plain_calls) == 2 and len(recompute_calls) == 4  # recompute: each layer's attention runs twice
    for a, b in zip(plain, replayed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("case, expected", [
    ("bf16 causal", True), ("fp32", False), ("amx", False), ("no bf16 units", False),
    ("explicit mask", False), ("not causal", False), ("too many keys", False), ("max keys", True)])
def test_beats_cpu_sdpa_only_where_measured(case, expected, monkeypatch):
    """Without dropout, only short causal attention in a 16-bit dtype the CPU computes natively
    without AMX leaves SDPA (where this function was measured faster)."""
    monkeypatch.setattr(cpu_attention, "cpu_has_amx", lambda: case == "amx")
    monkeypatch.setattr(cpu_attention, "compute_dtype",
                        lambda dtype: torch.float32 if case == "no bf16 units" else dtype)
    keys = {"too many keys": cpu_attention.MAX_KEYS + 1, "max keys": cpu_attention.MAX_KEYS}.get(case, 16)
    q = torch.zeros(1, 2, 16, 4, dtype=torch.float32 if case == "fp32" else torch.bfloat16)
    k = torch.zeros(1, 2, keys, 4, dtype=q.dtype)
    allowed = torch.ones(16, keys, dtype=torch.bool) if case == "explicit mask" else None
    assert cpu_attention.beats_cpu_sdpa(q, k, allowed, case != "not causal") is expected


@pytest.mark.parametrize("beats", [True, False])
def test_training_layers_without_dropout_follow_the_rule(beats, monkeypatch):
    """A bf16 layer without attention dropout runs here when beats_cpu_sdpa says so, else SDPA; both
    give the fp32 layer's output and gradients within bf16 tolerance."""
    from megatron_lite.models import attention

    calls = []
    monkeypatch.setattr(attention, "beats_cpu_sdpa", lambda *args: beats)
    monkeypatch.setattr(attention, "cpu_core_attention", lambda *a: calls.append(1) or cpu_core_attention(*a))
    results = {dtype: _dropout_free_layer(dtype) for dtype in (torch.float32, torch.bfloat16)}
    assert len(calls) == (2 if beats else 0)  # one per layer (the patched rule says yes to fp32 too)
    for ref, low in zip(results[torch.float32], results[torch.bfloat16]):
        torch.testing.assert_close(low.float(), ref, rtol=5e-2, atol=5e-2)


def _dropout_free_layer(dtype):
    from megatron_lite.config import ModelConfig
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.parallel.state import ParallelState
    from tests.model_helpers import build_gpt

    state = ParallelState()
    model_parallel_seed(3, state)
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, seq_length=8, max_position_embeddings=8,
                      vocab_size=32, attention_dropout=0.0, hidden_dropout=0.0)
    layer = build_gpt(cfg, state, seed=1).decoder.layers[0].to(dtype)
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]
