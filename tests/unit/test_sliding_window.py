"""Sliding-window attention (--window-size LEFT RIGHT, --window-attn-skip-freq), in one process.

The core attention equals a banded softmax written out here (fp32, 1e-6) on every path (SDPA, the
unfused math, the CPU dropout kernel; grouped-query heads, packed documents, queries after cached
keys); keys beyond the window change nothing; Megatron-LM's layer rule for the skip frequency;
cached decoding (the static cache and the paged one, rows of different lengths) equals a full
recompute for sequences several times longer than the window (1e-5); refusals name the flag.
TP2 / CP2: tests/distributed/test_sliding_window_parallel.py; Mistral / Qwen2 import:
tests/unit/test_hf_sliding_window.py.
"""

import math

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.inference.kv_cache import KVCache
from megatron_lite.inference.paged_cache import PagedCache
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.models.attention import DotProductAttention
from megatron_lite.models.window_config import layer_window
from megatron_lite.parallel.random import TP_RNG, RNGStatesTracker
from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused
from tests.inference_helpers import assert_close, randomize

ATOL = 1e-6


def banded_reference(q, k, v, left, right, causal=True, ids=None):
    """softmax(q k^T / sqrt(d) + band) v written out: ``q [s, b, nq, d]``, ``k, v [sk, b, nkv, d]``,
    queries at the last ``s`` of the ``sk`` positions; returns ``[s, b, nq * d]``."""
    s, b, nq, d = q.shape
    sk, nkv = k.shape[0], k.shape[2]
    k, v = (t.repeat_interleave(nq // nkv, dim=2) for t in (k, v))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(d)
    allowed = torch.zeros(b, 1, s, sk, dtype=torch.bool)
    for i in range(s):
        pos = sk - s + i
        for j in range(sk):
            ok = (left < 0 or pos - j <= left) and (right < 0 or j - pos <= right) and (not causal or j <= pos)
            if ids is not None:
                ok_b = torch.tensor([bool(ok) and bool(ids[r, pos] == ids[r, j]) for r in range(b)])
                allowed[:, 0, i, j] = ok_b
            else:
                allowed[:, 0, i, j] = ok
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(s, b, nq * d)


def core(window, fused=True, dropout=0.0, layer=1, skip=None, layers=2):
    cfg = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, attention_dropout=dropout,
                            masked_softmax_fusion=fused, window_size=window, window_attn_skip_freq=skip)
    return DotProductAttention(cfg, ParallelState(), layer)


def qkv(s=12, b=2, nq=4, nkv=2, d=8, sk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = sk or s
    return (torch.randn(s, b, nq, d, generator=g), torch.randn(sk, b, nkv, d, generator=g),
            torch.randn(sk, b, nkv, d, generator=g))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window", [(3, 0), (0, 0), (5, -1), (2, 2), (-1, 1)])
def test_core_attention_equals_the_banded_softmax(window, fused):
    q, k, v = qkv()
    out = core(list(window), fused)(q, k, v)
    torch.testing.assert_close(out, banded_reference(q, k, v, *window), rtol=0, atol=ATOL)
    full = banded_reference(q, k, v, -1, -1)
    if window[0] >= 0:  # the window really cuts something
        assert (out - full).abs().max() > 1e-2


@pytest.mark.parametrize("window", [(3, 0), (1, 2)])
def test_bidirectional_attention_sees_the_right_side(window):
    q, k, v = qkv()
    out = core(list(window))(q, k, v, None, False)
    torch.testing.assert_close(out, banded_reference(q, k, v, *window, causal=False), rtol=0, atol=ATOL)


def test_queries_after_cached_keys_and_packed_documents():
    q, k, v = qkv(s=3, sk=11)  # 3 new queries at positions 8..10 over 11 keys (bottom-right aligned)
    torch.testing.assert_close(core([4, 0])(q, k, v), banded_reference(q, k, v, 4, 0), rtol=0, atol=ATOL)
    q, k, v = qkv(s=12)
    ids = torch.tensor([[0] * 7 + [1] * 5, [0] * 2 + [1] * 10])
    torch.testing.assert_close(core([3, 0])(q, k, v, ids), banded_reference(q, k, v, 3, 0, ids=ids),
                               rtol=0, atol=ATOL)


@pytest.mark.parametrize("fused", [True, False])
def test_keys_beyond_the_window_change_nothing_also_with_dropout(fused):
    q, k, v = qkv(s=10)
    attn = core([3, 0], fused, dropout=0.3).train()
    attn.tracker = RNGStatesTracker()
    attn.tracker.add(TP_RNG, 5)
    start = attn.tracker.get_states()
    k2, v2 = k.clone(), v.clone()
    k2[:5], v2[:5] = 100.0, -100.0  # keys 0..4: outside the window of queries 8 and 9
    a = attn(q, k, v)[8:]
    attn.tracker.set_states(start)
    b = attn(q, k2, v2)[8:]
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_megatrons_layer_rule():
    cfg = TransformerConfig(num_layers=8, hidden_size=32, num_attention_heads=4, window_size=[4, 0],
                            window_attn_skip_freq="4")
    assert [layer_window(cfg, n) is None for n in range(1, 9)] == [False, False, False, True] * 2
    cfg.window_attn_skip_freq = "[1, 0] + [1] * 5 + [0]"  # 1 = sliding window
    assert [layer_window(cfg, n) for n in range(1, 9)] == [(4, 0), None] + [(4, 0)] * 5 + [None]
    cfg.window_attn_skip_freq = None
    assert all(layer_window(cfg, n) == (4, 0) for n in range(1, 9))
    cfg.window_size = [-1, -1]
    assert layer_window(cfg, 1) is None


# -- cached decoding ---------------------------------------------------------------------------------

def windowed_model(window=(3, 0), skip="2", seed=3):
    cfg = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8,
                      group_query_attention=True, num_query_groups=4, seq_length=48, vocab_size=100,
                      padded_vocab_size=104, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      attention_dropout=0.0, hidden_dropout=0.0, window_size=list(window),
                      window_attn_skip_freq=skip)
    model = GPTModel(TransformerConfig.from_model(cfg), ParallelState())
    randomize(model, seed)
    return model.eval()


def test_cached_decoding_equals_full_recompute_past_the_window():
    model = windowed_model()
    tokens = torch.randint(0, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    cache = KVCache(2, 40)
    with torch.no_grad():
        logits = model(tokens, inference_context=cache)
        cache.advance(tokens.shape[1])
        assert_close(logits, model(tokens), what="prefill")
        for step in range(20):
            new = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, new], dim=1)
            logits = model(new, inference_context=cache)
            cache.advance(1)
            assert_close(logits, model(tokens)[:, -1:], what=f"step {step}")
        unwindowed = windowed_model(window=(-1, -1))
        assert (unwindowed(tokens) - model(tokens)).abs().max() > 1e-2  # the window matters here


def test_paged_rows_of_different_lengths_equal_each_row_alone():
    model = windowed_model(window=(4, 0), skip=None)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 99, (1, n), generator=g) for n in (11, 4)]
    cache = PagedCache(2, 40, block_size=4)
    ids = cache.allocate(2, 40)
    with torch.no_grad():
        for r, t in zip(ids, rows):  # prefill each row alone, in two chunks
            for lo, hi in ((0, 3), (3, t.shape[1])):
                pos, mask = cache.begin([r], hi - lo, "cpu")
                model(t[:, lo:hi], position_ids=pos, attention_mask=mask, inference_context=cache)
                cache.advance()
        nxt = torch.tensor([[5], [7]])
        for step in range(12):  # both rows decode together, at different lengths
            pos, mask = cache.begin(ids, 1, "cpu")
            logits = model(nxt, position_ids=pos, attention_mask=mask, inference_context=cache)
            cache.advance()
            rows = [torch.cat([t, nxt[i:i + 1]], dim=1) for i, t in enumerate(rows)]
            for i, t in enumerate(rows):
                assert_close(logits[i:i + 1], model(t)[:, -1:], what=f"row {i} step {step}")
            nxt = logits[:, -1].argmax(-1, keepdim=True)


# -- flags -------------------------------------------------------------------------------------------

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]


def test_flags_parse():
    from megatron_lite.arguments import parse_args

    model = parse_args(BASE + ["--window-size", "8", "0", "--window-attn-skip-freq", "2"], world_size=1).model
    assert model.window_size == [8, 0] and model.window_attn_skip_freq == "2"
    assert parse_args(BASE, world_size=1).model.window_size is None


@pytest.mark.parametrize("extra, words", [
    (["--window-attn-skip-freq", "2"], ("--window-attn-skip-freq needs --window-size",)),
    (["--window-size", "8,0"], ("Megatron-LM's spelling of two values", "--window-size 8 0")),
    (["--window-size=(8,0)"], ("--window-size 8 0",)),
    (["--window-size", "-2", "0"], ("--window-size -2 0",)),
    (["--window-size", "8", "0", "--window-attn-skip-freq", "0"], ("--window-attn-skip-freq 0",)),
    (["--window-size", "8", "0", "--window-attn-skip-freq", "[1,0]"], ("list of 4 zeros and ones",)),
    (["--window-size", "8", "0", "--window-attn-skip-freq", "x"], ("--window-attn-skip-freq x",)),
    (["--window-size", "8", "0", "--multi-latent-attention", "--position-embedding-type", "rope"],
     ("--window-size is not supported with --multi-latent-attention",)),
])
def test_bad_values_exit_2_naming_the_flag(extra, words, capsys):
    parse_refused(capsys, BASE + extra, *words, world_size=1)


def test_flash_kernels_get_the_window():
    """The flash-attn path (GPU only) with stand-in kernels that apply ``window_size`` as flash-attn
    documents it: the layer must hand them its window and give the banded result."""
    seen = []

    def dense(q, k, v, dropout_p, softmax_scale, causal, window_size=(-1, -1)):
        seen.append(window_size)
        out = banded_reference(*(t.transpose(0, 1) for t in (q, k, v)), *window_size, causal=causal)
        return out.view(q.shape[1], q.shape[0], q.shape[2], -1).transpose(0, 1)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size=(-1, -1)):
        seen.append(window_size)
        out = torch.empty_like(q)
        for lo, hi in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            part = [t[lo:hi].unsqueeze(1) for t in (q, k, v)]  # [n, 1, heads, d]
            out[lo:hi] = banded_reference(*part, *window_size, causal=causal).view(hi - lo, q.shape[1], -1)
        return out

    attn = core([3, 0])
    attn.flash = (dense, varlen)
    attn._flash_applies = lambda q, mask: True
    q, k, v = qkv()
    torch.testing.assert_close(attn(q, k, v), banded_reference(q, k, v, 3, 0), rtol=0, atol=ATOL)
    ids = torch.tensor([[0] * 7 + [1] * 5, [0] * 2 + [1] * 10])
    torch.testing.assert_close(attn(q, k, v, ids), banded_reference(q, k, v, 3, 0, ids=ids), rtol=0, atol=ATOL)
    assert seen == [(3, 0), (3, 0)]
    full = core(None)
    full.flash, full._flash_applies = (dense, varlen), attn._flash_applies
    full(q, k, v)
    assert seen[-1] == (-1, -1)  # no window: flash-attn's own default


def test_a_spec_whose_core_attention_ignores_the_window_is_refused(tmp_path, capsys):
    path = tmp_path / "my_attention.py"
    path.write_text("import torch\nfrom megatron_lite.models.attention import DotProductAttention\n"
                    "from megatron_lite.models.spec import LayerSpec\n\n\n"
                    "class Mine(torch.nn.Module):\n    def __init__(self, config, state, layer_number):\n"
                    "        super().__init__()\n\n\n"
                    "class Stock(DotProductAttention):\n    pass\n\n\n"
                    "mine, stock = LayerSpec(core_attention=Mine), LayerSpec(core_attention=Stock)\n")
    window = ["--window-size", "4", "0"]
    from megatron_lite.arguments import parse_args

    parse_args(BASE + ["--spec", str(path), "mine"], world_size=1)  # no window: nothing to drop
    assert parse_args(BASE + window + ["--spec", str(path), "stock"], world_size=1).model.window_size == [4, 0]
    parse_refused(capsys, BASE + window + ["--spec", str(path), "mine"], "--window-size", "core_attention Mine",
                  world_size=1)


def test_a_gpt_refuses_a_right_side(capsys):
    import pretrain_gpt
    from megatron_lite.models.window_config import check_causal_window
    from tests.cli_errors import refused_line

    for right in ("2", "-1"):
        refused_line(capsys, lambda r=right: pretrain_gpt.main(BASE + ["--window-size", "8", r]),
                     f"--window-size 8 {right}: a GPT is causal", "give --window-size 8 0")
    check_causal_window([-1, -1])  # full attention, spelled out
    check_causal_window([8, 0])


@pytest.mark.parametrize("fused", [True, False])
def test_bert_window_with_padding_equals_the_sequence_alone(fused):
    """A padding query whose window holds only padding keys keeps its own key: its row stays finite
    (an empty row was NaN on the unfused path and reached the real tokens through the values)."""
    from megatron_lite.models import BertModel

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                      padded_vocab_size=104, attention_dropout=0.0, hidden_dropout=0.0, window_size=[2, 1])
    config = TransformerConfig.from_model(cfg)
    config.masked_softmax_fusion = fused
    model = BertModel(config, ParallelState(), num_tokentypes=0, add_binary_head=False)
    randomize(model, 5)
    tokens = torch.randint(0, 99, (1, 16), generator=torch.Generator().manual_seed(6))
    padding = torch.ones(1, 16)
    padding[0, 6:] = 0
    with torch.no_grad():
        padded, alone = model.eval()(tokens, padding_mask=padding)[0], model(tokens[:, :6])[0]
    assert torch.isfinite(padded).all()
    assert_close(padded[:, :6], alone, what="real positions")
