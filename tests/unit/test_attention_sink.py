"""Attention sinks (--softmax-type off-by-one / learnable) against the formula written out.

``p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k))`` over the allowed keys: every core-attention path
(SDPA's replacement, --no-masked-softmax-fusion, the CPU dropout kernel with its keep mask, the
block kernels of one-rank ring attention), GQA, packed documents, sliding windows and queries after
cached keys; forward and the gradients of q, k, v and the sinks (fp32, atol 1e-5). The model: the
parameter's name, shape and TP marks; selective recompute gives the same gradients; cached and paged
decoding equal a full recompute. TP2 / CP2: tests/distributed/test_attention_sink_parallel.py;
TP2 training, torch_dist resume at TP1: tests/e2e/test_model_family_flags.py.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.fusions.dropout import keep_mask
from megatron_lite.inference.kv_cache import KVCache
from megatron_lite.inference.paged_cache import PagedCache
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.models.attention import DotProductAttention
from megatron_lite.parallel.random import TP_RNG, RNGStatesTracker
from megatron_lite.parallel.ring_attention import ring_attention
from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused
from tests.inference_helpers import assert_close, randomize

ATOL = 1e-5


def sink_reference(q, k, v, sink, allowed, dropped=None):
    """The formula: ``q [s, b, nq, d]``, ``k, v [sk, b, nkv, d]``, ``allowed [b, 1, s, sk]``; ``dropped``
    (``[b, nq, s, sk]`` keep / (1 - p)) multiplies the probabilities. Returns ``[s, b, nq * d]``."""
    s, b, nq, d = q.shape
    k, v = (t.repeat_interleave(nq // k.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(d)
    num = torch.exp(scores).masked_fill(~allowed, 0.0)
    probs = num / (num.sum(-1, keepdim=True) + torch.exp(sink).view(1, nq, 1, 1))
    if dropped is not None:
        probs = probs * dropped
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(s, b, nq * d)


def core(kind="learnable", fused=True, dropout=0.0, window=None):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=dropout,
                            masked_softmax_fusion=fused, softmax_type=kind, window_size=window)
    attn = DotProductAttention(cfg, ParallelState(), 1)
    if attn.softmax_offset is not None:
        with torch.no_grad():
            attn.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
    return attn


def inputs(s=12, sk=None, b=2, nq=4, nkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = sk or s
    return [t.requires_grad_() for t in (torch.randn(s, b, nq, d, generator=g), torch.randn(sk, b, nkv, d, generator=g),
                                         torch.randn(sk, b, nkv, d, generator=g))]


def causal_allowed(b, s, sk):
    return torch.ones(s, sk, dtype=torch.bool).tril(sk - s).expand(b, 1, s, sk)


def compare(attn, q, k, v, mask, allowed, causal=True, dropped=None):
    """Output and gradients (q, k, v, the sinks) of ``attn`` equal the formula's."""
    sink = attn.softmax_offset if attn.softmax_offset is not None else torch.zeros(q.shape[2])
    ref_sink = sink.detach().clone().requires_grad_()
    dout = torch.randn(q.shape[0], q.shape[1], q.shape[2] * v.shape[3], generator=torch.Generator().manual_seed(5))
    leaves = [q, k, v]
    ref = sink_reference(q, k, v, ref_sink, allowed, dropped)
    want = torch.autograd.grad(ref, leaves + [ref_sink], dout)
    got_out = attn(q, k, v, mask, causal)
    params = [attn.softmax_offset] if attn.softmax_offset is not None else []
    got = torch.autograd.grad(got_out, leaves + params, dout)
    torch.testing.assert_close(got_out, ref, rtol=1e-5, atol=ATOL)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["learnable", "off-by-one"])
def test_causal_gqa_equals_the_formula(kind, fused):
    q, k, v = inputs()
    compare(core(kind, fused), q, k, v, None, causal_allowed(2, 12, 12))


@pytest.mark.parametrize("fused", [True, False])
def test_queries_after_cached_keys_documents_and_window(fused):
    q, k, v = inputs(s=3, sk=10)  # the last 3 of 10 positions, a cache's dense mask (True = masked out)
    masked = ~causal_allowed(2, 3, 10).clone()
    masked[1, :, :, :4] = True  # row 1: its first 4 keys are another request's
    compare(core(fused=fused), q, k, v, masked, ~masked)
    q, k, v = inputs(s=12, seed=1)
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    pos = torch.arange(12)
    allowed = (ids[:, :, None] == ids[:, None, :]).unsqueeze(1) & (pos[None, :] <= pos[:, None])
    allowed = allowed & (pos[:, None] - pos[None, :] <= 3)  # window (3, 0)
    compare(core(fused=fused, window=[3, 0]), q, k, v, ids, allowed)


def test_cpu_dropout_kernel_equals_the_formula_with_its_keep_mask():
    q, k, v = inputs()
    attn = core(dropout=0.3).train()
    attn.tracker = RNGStatesTracker()
    attn.tracker.add(TP_RNG, 5)
    start = attn.tracker.get_states()
    with attn.tracker.fork():  # the kernel draws one keep mask [b * nkv, group * s, s] (one block)
        keep = keep_mask((2 * 2, 2 * 12, 12), 0.3).view(2, 4, 12, 12)
    attn.tracker.set_states(start)
    compare(attn, q, k, v, None, causal_allowed(2, 12, 12), dropped=keep.float() / 0.7)


def test_ring_kernels_merge_the_sink_once():
    q, k, v = (t.detach().permute(1, 2, 0, 3).requires_grad_() for t in inputs())
    sink = torch.tensor([-1.0, 0.5, 2.0, 0.0], requires_grad=True)
    out = ring_attention(q, k, v, None, True, 8 ** -0.5, sink=sink)
    ref = sink_reference(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), sink, causal_allowed(2, 12, 12))
    torch.testing.assert_close(out.permute(2, 0, 1, 3).reshape(12, 2, 32), ref, rtol=1e-5, atol=ATOL)
    g = torch.autograd.grad(out.sum(), sink)[0]
    torch.testing.assert_close(g, torch.autograd.grad(ref.sum(), sink)[0], rtol=1e-5, atol=ATOL)


def test_vanilla_and_off_by_one_have_no_parameter_learnable_one_per_local_head():
    assert core("vanilla").softmax_offset is None and core("off-by-one").softmax_offset is None
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=8, softmax_type="learnable",
                            tensor_model_parallel_size=2)
    p = DotProductAttention(cfg, SimpleNamespace(tp_size=2, rng_tracker=None), 1).softmax_offset
    assert p.shape == (4,) and p.tensor_model_parallel and p.partition_dim == 0 and not p.any()


# -- the model: recompute, cached decoding -----------------------------------------------------------

def sink_model(seed=3, **over):
    kw = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8, group_query_attention=True,
              num_query_groups=4, seq_length=48, vocab_size=100, padded_vocab_size=104, position_embedding_type="rope",
              normalization="RMSNorm", swiglu=True, attention_dropout=0.0, hidden_dropout=0.0,
              softmax_type="learnable", window_size=[3, 0], window_attn_skip_freq="2")
    kw.update(over)
    run = {k: kw.pop(k) for k in ("recompute_granularity", "recompute_method") if k in kw}
    model = GPTModel(TransformerConfig.from_model(ModelConfig(**kw), **run), ParallelState())
    randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_offset"):
                p.copy_(torch.linspace(-2, 3, p.numel()))  # large enough to matter
    return model


def test_selective_and_full_recompute_give_the_same_gradients():
    tokens = torch.randint(0, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for recompute, method in ((None, None), ("selective", None), ("full", "uniform")):
        model = sink_model(recompute_granularity=recompute, recompute_method=method)
        model(tokens, labels=tokens).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert "decoder.layers.0.self_attention.core_attention.softmax_offset" in grads[0]
    for name, g in grads[0].items():
        for other in grads[1:]:
            torch.testing.assert_close(other[name], g, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert grads[0]["decoder.layers.1.self_attention.core_attention.softmax_offset"].abs().min() > 0


def test_cached_and_paged_decoding_equal_full_recompute():
    model = sink_model().eval()
    tokens = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    cache = KVCache(2, 40)
    with torch.no_grad():
        logits = model(tokens, inference_context=cache)
        cache.advance(tokens.shape[1])
        assert_close(logits, model(tokens), what="prefill")
        for step in range(6):
            new = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, new], dim=1)
            logits = model(new, inference_context=cache)
            cache.advance(1)
            assert_close(logits, model(tokens)[:, -1:], what=f"step {step}")
        vanilla = sink_model(softmax_type="vanilla").eval()
        assert (vanilla(tokens) - model(tokens)).abs().max() > 1e-2  # the sinks matter here
        rows = [tokens[:1, :9], tokens[1:, :4]]
        paged = PagedCache(2, 40, block_size=4)
        ids = paged.allocate(2, 40)
        for r, t in zip(ids, rows):
            pos, mask = paged.begin([r], t.shape[1], "cpu")
            model(t, position_ids=pos, attention_mask=mask, inference_context=paged)
            paged.advance()
        nxt = torch.tensor([[5], [7]])
        for step in range(4):  # both rows decode together, at different lengths (padded queries)
            pos, mask = paged.begin(ids, 1, "cpu")
            logits = model(nxt, position_ids=pos, attention_mask=mask, inference_context=paged)
            paged.advance()
            rows = [torch.cat([t, nxt[i:i + 1]], dim=1) for i, t in enumerate(rows)]
            for i, t in enumerate(rows):
                assert_close(logits[i:i + 1], model(t)[:, -1:], what=f"paged row {i} step {step}")
            nxt = logits[:, -1].argmax(-1, keepdim=True)


# -- flags -------------------------------------------------------------------------------------------

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


def test_flag_parses_and_bad_values_exit_2(capsys):
    from megatron_lite.arguments import parse_args

    assert parse_args(BASE, world_size=1).model.softmax_type == "vanilla"
    assert parse_args(BASE + ["--softmax-type", "learnable"], world_size=1).model.softmax_type == "learnable"
    parse_refused(capsys, BASE + ["--softmax-type", "sigmoid"], "--softmax-type", world_size=1)


def test_a_spec_whose_core_attention_has_no_sink_is_refused(tmp_path, capsys):
    path = tmp_path / "my_attention.py"
    path.write_text("import torch\nfrom megatron_lite.models.spec import LayerSpec\n\n\n"
                    "class Mine(torch.nn.Module):\n    def __init__(self, config, state, layer_number):\n"
                    "        super().__init__()\n\n\nmine = LayerSpec(core_attention=Mine)\n")
    parse_refused(capsys, BASE + ["--softmax-type", "off-by-one", "--spec", str(path), "mine"], "--softmax-type",
                  "core_attention Mine", world_size=1)


def test_mla_takes_the_sinks_through_its_core_attention_and_latent_cache():
    from megatron_lite.models.mla import MLASelfAttention
    from megatron_lite.models.yarn import rotary_tables
    from tests.unit.test_mla import B, H, S, _positions, make_config

    outs = []
    for kind in ("learnable", "vanilla"):
        cfg = make_config("dsv3", softmax_type=kind)
        mla = MLASelfAttention(cfg, ParallelState(world_size=1, rank=0), 1).eval()
        if kind == "learnable":
            with torch.no_grad():
                mla.core_attention.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            full = mla(x, rotary=rotary_tables(cfg, _positions(0, S)))
            cache, pieces = KVCache(B, S), []
            for start, end in [(0, 5)] + [(i, i + 1) for i in range(5, S)]:
                pieces.append(mla(x[start:end], rotary=rotary_tables(cfg, _positions(start, end - start)),
                                  inference_context=cache))
                cache.advance(end - start)
        torch.testing.assert_close(torch.cat(pieces), full, rtol=1e-5, atol=1e-5)
        outs.append(full)
    assert (outs[0] - outs[1]).abs().max() > 1e-3  # the sinks are applied


def test_plain_block_kernel_the_accelerators_path_equals_the_formula(monkeypatch):
    """Off the CPU (or in fp16) the block kernels compute in plain fp32: the same sink, same gradients."""
    from megatron_lite.parallel import ring_attention as ring

    monkeypatch.setattr(ring, "_use_cpu_flash", lambda q, p: False)
    q, k, v = inputs(s=3, sk=10)
    masked = ~causal_allowed(2, 3, 10).clone()
    masked[0, :, :, :6] = True
    compare(core(), q, k, v, masked, ~masked)
