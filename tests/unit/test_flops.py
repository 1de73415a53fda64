"""FLOPs formula: equals the spec's closed form for the classic GPT, and for GQA / SwiGLU / any ffn
size equals an independent count of every matmul (torch's FlopCounterMode on a reference model)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.config import ModelConfig
from megatron_lite.perf.flops import (
    mfu,
    num_floating_point_operations,
    spec_formula,
)
from megatron_lite.perf.matmul_peak import measure_matmul_peak


@pytest.mark.parametrize("B,s,l,h,heads,V", [(4, 512, 6, 768, 12, 32768), (8, 2048, 24, 2048, 16, 51200),
                                              (1, 128, 2, 64, 4, 1024)])
@pytest.mark.parametrize("recompute", [False, True])
def test_equals_spec_formula_for_classic_gpt(B, s, l, h, heads, V, recompute):
    cfg = ModelConfig(num_layers=l, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=heads,
                      seq_length=s, vocab_size=V, padded_vocab_size=V)
    got = num_floating_point_operations(cfg, B, recompute_full=recompute)
    want = spec_formula(B, s, l, h, V, recompute_full=recompute)
    assert got == pytest.approx(want, rel=1e-12)


def test_unset_derived_fields_default_to_classic_gpt():
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000)
    assert num_floating_point_operations(cfg, 3) == pytest.approx(spec_formula(3, 32, 2, 64, 1000), rel=1e-12)


def _reference_train_step_flops(cfg, B):
    """Matmul FLOPs of forward + backward of a plain-torch GPT of ``cfg``'s shapes, counted by torch."""
    h, s, heads, d = cfg.hidden_size, cfg.seq_length, cfg.num_attention_heads, cfg.kv_channels
    g, f, V = cfg.num_query_groups, cfg.ffn_hidden_size, cfg.padded_vocab_size
    torch.manual_seed(0)

    def w(*shape):
        return (0.02 * torch.randn(*shape)).requires_grad_()

    emb = w(V, h)
    layers = [dict(q=w(heads * d, h), kv=w(2 * g * d, h), o=w(h, heads * d),
                   up=w(f * (2 if cfg.swiglu else 1), h), down=w(h, f)) for _ in range(cfg.num_layers)]
    out_w = w(V, h)
    tokens = torch.randint(0, V, (B, s))
    with FlopCounterMode(display=False) as counter:
        x = emb[tokens]  # [B, s, h]
        for p in layers:
            q = F.linear(x, p["q"]).view(B, s, heads, d).transpose(1, 2)
            k, v = F.linear(x, p["kv"]).view(B, s, 2, g, d).permute(2, 0, 3, 1, 4)
            k, v = k.repeat_interleave(heads // g, dim=1), v.repeat_interleave(heads // g, dim=1)
            probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
            x = x + F.linear((probs @ v).transpose(1, 2).reshape(B, s, heads * d), p["o"])
            up = F.linear(x, p["up"])
            if cfg.swiglu:
                a, b = up.chunk(2, dim=-1)
                up = F.silu(a) * b
            else:
                up = F.gelu(up)
            x = x + F.linear(up, p["down"])
        loss = F.cross_entropy(F.linear(x, out_w).view(-1, V), tokens.view(-1))
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("heads,groups,kv,ffn,swiglu", [
    (4, 4, 16, 256, False),   # classic MHA, 4h
    (4, 2, 16, 256, False),   # GQA
    (4, 1, 16, 96, True),     # MQA + SwiGLU, ffn != 4h
    (4, 4, 8, 200, True),     # kv_channels * heads != hidden
])
def test_general_count_equals_independent_matmul_count(heads, groups, kv, ffn, swiglu):
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                      kv_channels=kv, ffn_hidden_size=ffn, swiglu=swiglu, seq_length=16, vocab_size=100,
                      padded_vocab_size=128)
    assert num_floating_point_operations(cfg, 3) == _reference_train_step_flops(cfg, 3)


def test_mfu_and_peak():
    assert mfu(50e9, 200e9) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        mfu(1.0, 0.0)
    peak = measure_matmul_peak(n=128, warmup=1, reps=2)
    assert math.isfinite(peak) and peak > 1e6  # any real CPU does > 1 MFLOP/s on a 128^3 matmul


def test_mla_layer_and_mtp_flops_equal_a_count_of_every_matmul():
    """MLA's forward FLOPs (both query forms) are what torch counts running the module; MTP adds one
    layer of the last kind, its 2h -> h projection and one more logits per depth (all x3 for training)."""
    import dataclasses

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_lite.models import TransformerConfig
    from megatron_lite.models.mla import MLASelfAttention
    from megatron_lite.models.yarn import rotary_tables
    from megatron_lite.parallel.state import ParallelState
    from megatron_lite.perf.flops import forward_flops_per_layer, logits_flops, mlp_flops

    B, S, H = 3, 16, 32
    for q_lora in (None, 16):
        cfg = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=S, ffn_hidden_size=48,
                                swiglu=True, multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=8,
                                qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, position_embedding_type="rope",
                                add_bias_linear=False, vocab_size=100, mtp_num_layers=2)
        mla = MLASelfAttention(cfg, ParallelState(world_size=1, rank=0), 1).eval()
        positions = torch.arange(S).unsqueeze(0).expand(B, -1)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            mla(torch.randn(S, B, H), rotary=rotary_tables(cfg, positions))
        attention = counter.get_total_flops()
        layer = forward_flops_per_layer(cfg, B)
        assert layer == attention + mlp_flops(B * S, H, 48, True)
        without = num_floating_point_operations(dataclasses.replace(cfg, mtp_num_layers=None), B)
        mtp = 2 * (layer + 2 * B * S * 2 * H * H + logits_flops(cfg, B))
        assert num_floating_point_operations(cfg, B) == pytest.approx(without + 3 * mtp, rel=1e-12)


def test_sliding_window_layers_count_the_keys_of_their_window():
    """Hand count, B=1 s=32 h=64 a=4 d=16 ffn=256 V=128, --window-size 7 0 on layer 1 of 2 ("[1,0]"):
    per layer QKV 2*32*64*192 + output 2*32*64*64 + MLP 2*2*32*64*256 = 3145728; scores and values
    2*2*32*w*64 with w = 8 keys (layer 1) or 32 (layer 2, full); logits 2*32*64*128; x3."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                      vocab_size=100, padded_vocab_size=128, window_size=[7, 0], window_attn_skip_freq="[1,0]")
    projections, logits = 3145728, 2 * 32 * 64 * 128
    want = 3 * (2 * projections + 2 * 2 * 32 * 8 * 64 + 2 * 2 * 32 * 32 * 64 + logits)
    assert num_floating_point_operations(cfg, 1) == want == 21430272
    full = ModelConfig(**{**vars(cfg), "window_size": None, "window_attn_skip_freq": None})
    assert num_floating_point_operations(full, 1) - want == 3 * 2 * 2 * 32 * (32 - 8) * 64
    from megatron_lite.perf.flops import attended_keys, core_attention_flops
    assert [attended_keys(cfg, w) for w in ((7, 0), (3, 2), (40, 0), (-1, 0), (5, -1), None)] == [8, 6, 32, 32, 32, 32]
    assert core_attention_flops(cfg, 2, (3, 2)) == 2 * 2 * 2 * 32 * 6 * 64  # a bidirectional (BERT) window
