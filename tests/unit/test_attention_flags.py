"""--rotary-interleaved, --softmax-scale, --attention-output-gate, --no-rope-freq
(megatron_lite/models/attention_config.py): each against a plain reference written here (complex
rotation of adjacent pairs; softmax(q k^T S) v; the gate's heads read from the fused QKV weight by
hand; a NoPE layer equals the same layer given no rotary tables), the fused rotary path equal to the
plain one, the layer pattern, a loaded checkpoint keeping the flags, and the refusals (exit 2, one
line). Cached decoding equals a full recompute: tests/unit/test_inference_engine.py (attn_flags);
TP2 + SP and CP2 against one process: tests/e2e/test_model_family_flags.py. fp32, tolerances 1e-5."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.models.attention import DotProductAttention, SelfAttention
from megatron_lite.models.attention_config import no_rope_layers
from megatron_lite.models.common import apply_rotary_interleaved, rotary_cos_sin
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused

TOL = dict(rtol=1e-5, atol=1e-5)


def _config(**over) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                position_embedding_type="rope", init_method_std=0.3, hidden_dropout=0.0, attention_dropout=0.0,
                add_bias_linear=False)
    return TransformerConfig(**{**base, **over})


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tables(s, dim, b=2):
    return rotary_cos_sin(torch.arange(s).unsqueeze(0).expand(b, -1), dim, 10000.0)


def test_interleaved_rotary_turns_each_adjacent_pair_as_a_complex_number():
    s, d = 7, 8
    x = _randn(s, 2, 3, d)
    cos, sin = _tables(s, d)
    pairs = torch.view_as_complex(x.reshape(s, 2, 3, d // 2, 2).contiguous())
    theta = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    turn = torch.polar(torch.ones(s, d // 2), torch.arange(s).float()[:, None] * theta)  # e^(i pos theta_i)
    want = torch.view_as_real(pairs * turn[:, None, None, :]).reshape(s, 2, 3, d)
    torch.testing.assert_close(apply_rotary_interleaved(x, cos, sin), want, **TOL)


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_fused_rotary_equals_plain_and_interleaved_differs_from_rotate_half(percent):
    x = _randn(6, 2, 32, seed=1)
    rotary = _tables(6, int(8 * percent))
    over = dict(rotary_percent=percent, rotary_interleaved=True)
    plain, fused = (SelfAttention(_config(apply_rope_fusion=f, **over), ParallelState(), 1) for f in (False, True))
    torch.testing.assert_close(fused(x, rotary=rotary), plain(x, rotary=rotary), **TOL)
    half = SelfAttention(_config(rotary_percent=percent), ParallelState(), 1)
    assert not torch.allclose(half(x, rotary=rotary), plain(x, rotary=rotary), atol=1e-3)


@pytest.mark.parametrize("fused_softmax", [True, False])
def test_softmax_scale_replaces_one_over_sqrt_head_size(fused_softmax):
    cfg = _config(softmax_scale=0.7, masked_softmax_fusion=fused_softmax, apply_query_key_layer_scaling=True,
                  attention_softmax_in_fp32=True)
    assert cfg.attention_scale == 0.7 and _config().attention_scale == 1 / math.sqrt(8)
    q, k, v = _randn(5, 2, 4, 8, seed=2), _randn(5, 2, 2, 8, seed=3), _randn(5, 2, 2, 8, seed=4)
    got = DotProductAttention(cfg, ParallelState(), 2)(q, k, v)
    qh, kh, vh = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    kh, vh = kh.repeat_interleave(2, dim=1), vh.repeat_interleave(2, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * 0.7 + torch.full((5, 5), float("-inf")).triu(1)
    want = (scores.softmax(-1) @ vh).permute(2, 0, 1, 3).reshape(5, 2, 32)
    torch.testing.assert_close(got, want, **TOL)


def test_output_gate_is_sigmoid_of_its_heads_in_the_qkv_weight_times_the_attention_output():
    cfg = _config(attention_output_gate=True)
    attn = SelfAttention(cfg, ParallelState(), 1)
    w = attn.linear_qkv.weight.detach()
    assert w.shape == ((4 * 2 + 2 * 2) * 8, 32)
    x = _randn(6, 2, 32, seed=5)
    rows = (x @ w.t()).view(6, 2, 2, 6, 8)  # per group: 2 query heads, 2 gate heads, key, value
    q, g = rows[:, :, :, :2].reshape(6, 2, 4, 8), rows[:, :, :, 2:4].reshape(6, 2, 32)
    k, v = rows[:, :, :, 4], rows[:, :, :, 5]
    qh = q.permute(1, 2, 0, 3)
    kh, vh = (t.permute(1, 2, 0, 3).repeat_interleave(2, dim=1) for t in (k, v))
    context = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).permute(2, 0, 1, 3).reshape(6, 2, 32)
    want = (context * torch.sigmoid(g)) @ attn.linear_proj.weight.detach().t()
    torch.testing.assert_close(attn(x), want, **TOL)


def test_no_rope_layers_follow_megatron_patterns_and_a_nope_layer_ignores_the_tables():
    assert no_rope_layers("4", 8) == [False, False, False, True] * 2
    assert no_rope_layers("([0]*3+[1]*1)*2", 8) == no_rope_layers(4, 8)
    assert no_rope_layers(None, 3) == [False] * 3
    for bad in ("3", "0", "[1,0]", "[2,0,0,0]", "x"):
        with pytest.raises(ValueError):
            no_rope_layers(bad, 4)
    cfg = _config(no_rope_freq="2")
    x, rotary = _randn(6, 2, 32, seed=6), _tables(6, 8)
    rope, nope = SelfAttention(cfg, ParallelState(), 1), SelfAttention(cfg, ParallelState(), 2)
    assert not rope.skips_rope and nope.skips_rope
    torch.testing.assert_close(nope(x, rotary=rotary), nope(x), **TOL)
    assert not torch.allclose(rope(x, rotary=rotary), rope(x), atol=1e-3)


def test_a_checkpoint_loaded_for_inference_keeps_the_four_flags(tmp_path):
    from megatron_lite.inference.loading import load_model
    from tests.inference_helpers import save_model

    save_model("attn_flags", str(tmp_path))
    model, _ = load_model(str(tmp_path))
    layers = model.decoder.layers
    assert [layer.self_attention.skips_rope for layer in layers] == [False, True, False, True]
    attention = layers[0].self_attention
    assert attention.gated and attention.core_attention.scale == 0.2
    assert attention.rotate.__name__.endswith("apply_rotary_interleaved")


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--position-embedding-type", "rope"]
MLA = ["--multi-latent-attention", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8"]
REFUSALS = {
    "N not dividing the layers": (["--no-rope-freq", "3"], ["--no-rope-freq 3", "divides --num-layers 4"]),
    "a list of the wrong length": (["--no-rope-freq", "[0,1]"], ["--no-rope-freq [0,1]", "list of 4"]),
    "no-rope without rope": (["--no-rope-freq", "2", "--position-embedding-type", "learned_absolute"],
                             ["--no-rope-freq 2", "rope"]),
    "no-rope with MTP": (["--no-rope-freq", "2", "--mtp-num-layers", "1"], ["--no-rope-freq 2", "--mtp-num-layers"]),
    "interleaved without rope": (["--rotary-interleaved", "--position-embedding-type", "learned_absolute"],
                                 ["--rotary-interleaved", "rope"]),
    "scale not positive": (["--softmax-scale", "0"], ["--softmax-scale", "positive"]),
    "interleaved with MLA": (["--rotary-interleaved"] + MLA, ["--rotary-interleaved", "--multi-latent-attention"]),
    "scale with MLA": (["--softmax-scale", "0.1"] + MLA, ["--softmax-scale 0.1", "--multi-latent-attention"]),
    "gate with MLA": (["--attention-output-gate"] + MLA, ["--attention-output-gate", "--multi-latent-attention"]),
    "no-rope with MLA": (["--no-rope-freq", "2"] + MLA, ["--no-rope-freq 2", "--multi-latent-attention"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(case, capsys):
    argv, words = REFUSALS[case]
    parse_refused(capsys, BASE + argv, *words, world_size=1)


def test_flags_parse_into_the_model_section():
    from megatron_lite.arguments import parse_args

    m = parse_args(BASE + ["--rotary-interleaved", "--softmax-scale", "0.25", "--attention-output-gate",
                           "--no-rope-freq", "([0]*3+[1])"], world_size=1).model
    assert (m.rotary_interleaved, m.softmax_scale, m.attention_output_gate, m.no_rope_freq) == \
        (True, 0.25, True, "([0]*3+[1])")


def test_the_gate_heads_count_in_the_flops():
    from megatron_lite.perf.flops import forward_flops_per_layer

    gated, plain = (forward_flops_per_layer(_config(attention_output_gate=g, seq_length=16), 2) for g in (True, False))
    assert gated - plain == 2 * (2 * 16) * 32 * 4 * 8  # 2 x tokens x hidden x heads x head size
