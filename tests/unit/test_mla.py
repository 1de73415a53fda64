"""Multi-latent attention, YaRN and multi-token prediction in one process, against references written here.

* :func:`_reference_mla` is MLA from the formulas (DeepSeek-V3's): explicit weight matrices read
  from the module's state dict, RMS/LayerNorm written out, the rotary part rotated as complex pairs
  ``(x[2i], x[2i+1]) * exp(i pos theta_i)`` (DeepSeek's / Hugging Face's interleaved form, not the
  module's de-interleave + rotate-half), YaRN frequencies from a per-channel loop, softmax written
  out. Output and the gradients of the input and of every parameter must agree (fp32, rtol 1e-5).
* YaRN's frequencies, table factor and MLA's softmax scale against their closed forms, with
  DeepSeek-V3's numbers (correction range 10..23, softmax scale 0.135234).
* A key/value cache: a prompt, then one token at a time, gives the full forward's outputs.
* MTP: GPTModel's stacked per-token losses against the depth-1 formula composed by hand.
* Core attention's flash-attn path (dense and variable-length) with a value head size of its own
  (stand-in kernels that, like flash-attn's, take one head size) equals its SDPA path.
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.inference.kv_cache import KVCache
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.models.attention import DotProductAttention
from megatron_lite.models.mla import MLASelfAttention
from megatron_lite.models.mtp import mtp_targets, roll_left
from megatron_lite.models.yarn import (
    correction_range,
    get_mscale,
    mla_softmax_scale,
    rotary_tables,
    yarn_inv_freq,
)
from megatron_lite.parallel.state import ParallelState

B, S, H = 2, 12, 32
MLA = dict(multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
           position_embedding_type="rope")
VARIANTS = {  # q compression + latent norms + YaRN (mscale != mscale_all_dim) / none of them, with biases
    "dsv3": dict(q_lora_rank=16, qk_layernorm=True, normalization="RMSNorm", rope_type="yarn",
                 rotary_scaling_factor=4.0, mscale=0.8, mscale_all_dim=0.5, original_max_position_embeddings=6000,
                 add_bias_linear=False),
    "plain": dict(rope_type="rope", normalization="LayerNorm", add_bias_linear=True),
}


def make_config(variant, **over) -> TransformerConfig:
    kw = dict(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=S, attention_dropout=0.0,
              hidden_dropout=0.0, seed=3, **MLA, **VARIANTS[variant])
    kw.update(over)
    return TransformerConfig(**kw)


def _positions(start, length):
    return torch.arange(start, start + length).unsqueeze(0).expand(B, -1)


# ---------------------------------------------------------------------------------------------
# The reference.


def _norm(x, sd, prefix, cfg):
    if prefix + ".weight" not in sd:
        return x
    if cfg.normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), sd[prefix + ".weight"], sd[prefix + ".bias"], cfg.norm_epsilon)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_epsilon) * sd[prefix + ".weight"]


def _ref_inv_freq(cfg):
    d, base = cfg.qk_pos_emb_head_dim, cfg.rotary_base
    plain = [base ** (-2 * i / d) for i in range(d // 2)]
    if cfg.rope_type != "yarn":
        return torch.tensor(plain), 1.0
    f = cfg.rotary_scaling_factor
    dim_of = lambda beta: d * math.log(cfg.original_max_position_embeddings / (2 * math.pi * beta)) / (2 * math.log(base))  # noqa: E731
    low, high = max(math.floor(dim_of(cfg.beta_fast)), 0), min(math.ceil(dim_of(cfg.beta_slow)), d - 1)
    high += 0.001 if high == low else 0
    freqs = []
    for i, w in enumerate(plain):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        freqs.append(w / f * ramp + w * (1 - ramp))
    m = lambda x: 1.0 if f <= 1 else 0.1 * x * math.log(f) + 1  # noqa: E731
    return torch.tensor(freqs), m(cfg.mscale) / m(cfg.mscale_all_dim)


def _rotate_pairs(x, positions, inv_freq, factor):
    """``x [s, b, n, d]`` rotated as complex pairs (x[2i] + i x[2i+1]) * exp(i pos theta_i) * factor."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    angles = positions.t().double()[:, :, None, None] * inv_freq.double()  # [s, b, 1, d/2]
    turned = pairs * torch.polar(torch.ones_like(angles), angles).to(pairs.dtype) * factor
    return torch.view_as_real(turned).reshape(x.shape)


def _reference_mla(sd, x, cfg, positions):
    """MLA from the formulas; ``sd``: the module's state dict (full weights, TP 1)."""
    s, b, _ = x.shape
    n, dn, dr, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    if "linear_q_proj.weight" in sd:
        q = x @ sd["linear_q_proj.weight"].t()
    else:
        q = _norm(x @ sd["linear_q_down_proj.weight"].t(), sd, "q_layernorm", cfg) @ sd["linear_q_up_proj.weight"].t()
    q = q.view(s, b, n, dn + dr)
    combined = x @ sd["linear_kv_down_proj.weight"].t()
    latent, k_rope = combined[..., :cfg.kv_lora_rank], combined[..., cfg.kv_lora_rank:]
    kv = (_norm(latent, sd, "kv_layernorm", cfg) @ sd["linear_kv_up_proj.weight"].t()).view(s, b, n, dn + dv)
    inv_freq, factor = _ref_inv_freq(cfg)
    q_rope = _rotate_pairs(q[..., dn:], positions, inv_freq, factor)
    k_rope = _rotate_pairs(k_rope.unsqueeze(2), positions, inv_freq, factor).expand(s, b, n, dr)
    query = torch.cat([q[..., :dn], q_rope], -1)
    key = torch.cat([kv[..., :dn], k_rope], -1)
    m = get_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
    scores = torch.einsum("qbnd,kbnd->bnqk", query, key) * m * m / math.sqrt(dn + dr)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bnqk,kbnd->qbnd", scores.softmax(-1), kv[..., dn:]).reshape(s, b, n * dv)
    out = out @ sd["linear_proj.weight"].t()
    return out + sd["linear_proj.bias"] if "linear_proj.bias" in sd else out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mla_equals_the_formulas_output_and_every_gradient(variant):
    cfg = make_config(variant)
    mla = MLASelfAttention(cfg, ParallelState(world_size=1, rank=0), 1)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    dout = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    xm = x.clone().requires_grad_()
    out = mla(xm, rotary=rotary_tables(cfg, _positions(0, S)))
    out.backward(dout)
    sd = {k: v.detach().clone().requires_grad_() for k, v in mla.state_dict().items()}
    assert ("linear_q_down_proj.weight" in sd) == (variant == "dsv3") and ("q_layernorm.weight" in sd) == (variant == "dsv3")
    xr = x.clone().requires_grad_()
    ref = _reference_mla(sd, xr, cfg, _positions(0, S))
    ref.backward(dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-5, atol=1e-6)
    grads = dict(mla.named_parameters())
    assert set(grads) == set(sd)
    for name, p in grads.items():
        torch.testing.assert_close(p.grad, sd[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_yarn_against_its_closed_form_with_deepseek_v3_numbers():
    assert correction_range(64, 10000, 4096, 32, 1) == (10, 23)
    assert correction_range(4, 10000, 6000, 32, 1) == (0, 2)  # the small model above: ramp 0, 0.5
    cfg = make_config("dsv3", qk_head_dim=128, qk_pos_emb_head_dim=64, rotary_scaling_factor=40.0, mscale=1.0,
                      mscale_all_dim=1.0, original_max_position_embeddings=4096, kv_channels=8)
    assert get_mscale(40, 1.0) == pytest.approx(0.1 * math.log(40) + 1) == pytest.approx(1.368888, abs=1e-6)
    assert mla_softmax_scale(cfg) == cfg.attention_scale == pytest.approx(0.135234, abs=1e-6)
    inv_freq = yarn_inv_freq(64, 10000, 40, 4096, 32, 1)
    extra = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(inv_freq[:11].double(), extra[:11], rtol=1e-6, atol=0)  # kept (ramp 0)
    torch.testing.assert_close(inv_freq[23:].double(), extra[23:] / 40, rtol=1e-6, atol=0)  # interpolated
    ramp = (17 - 10) / 13
    assert float(inv_freq[17]) == pytest.approx(float(extra[17]) * (ramp / 40 + 1 - ramp), rel=1e-6)
    # the table factor get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) multiplies cos and sin
    other = make_config("dsv3", rotary_scaling_factor=4.0, mscale=0.8, mscale_all_dim=0.5)
    cos, sin = rotary_tables(other, _positions(0, S))
    factor = (0.08 * math.log(4) + 1) / (0.05 * math.log(4) + 1)
    torch.testing.assert_close(cos.pow(2) + sin.pow(2), torch.full_like(cos, factor ** 2), rtol=1e-6, atol=0)
    # factor 1 is plain RoPE, and a non-MLA model's scale is 1/sqrt(head size)
    assert yarn_inv_freq(64, 10000, 1.0, 4096, 32, 1).tolist() == pytest.approx(extra.tolist(), rel=1e-6)
    assert TransformerConfig(hidden_size=H, num_attention_heads=4).attention_scale == 1 / math.sqrt(8)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kv_cache_prompt_then_one_token_at_a_time_equals_full_forward(variant):
    cfg = make_config(variant)
    mla = MLASelfAttention(cfg, ParallelState(world_size=1, rank=0), 1).eval()
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = mla(x, rotary=rotary_tables(cfg, _positions(0, S)))
        cache, prompt, pieces = KVCache(B, S), 5, []
        for start, end in [(0, prompt)] + [(i, i + 1) for i in range(prompt, S)]:
            pieces.append(mla(x[start:end], rotary=rotary_tables(cfg, _positions(start, end - start)),
                              inference_context=cache))
            cache.advance(end - start)
    assert cache.memory[1][0].shape[-1] == cfg.kv_lora_rank and cache.memory[1][1].shape[-2:] == (1, 4)
    torch.testing.assert_close(torch.cat(pieces), full, rtol=1e-5, atol=1e-5)


def test_mtp_losses_equal_the_depth_one_formula():
    """Row 1 of the stacked losses is CE(output_layer(final_norm(layer(eh_proj([enorm(E t(i+1)) ;
    hnorm(h(i))])))), t(i+2)), composed here from the model's own pieces; row 0 is the plain model's loss."""
    mcfg = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=S, vocab_size=50,
                       padded_vocab_size=64, attention_dropout=0.0, hidden_dropout=0.0, mtp_num_layers=2,
                       untie_embeddings_and_output_weights=True, **MLA, **{k: v for k, v in VARIANTS["dsv3"].items()
                                                                        if k != "add_bias_linear"})
    cfg = TransformerConfig.from_model(mcfg)
    model = GPTModel(cfg, ParallelState(world_size=1, rank=0))
    g = torch.Generator().manual_seed(6)
    tokens, labels = torch.randint(0, 50, (B, S), generator=g), torch.randint(0, 50, (B, S), generator=g)
    targets = mtp_targets(tokens, labels, torch.ones(B, S), 2)
    assert torch.equal(targets["mtp_tokens"][1, :, :-2], tokens[:, 2:]) and not targets["mtp_labels"][1, :, -2:].any()
    losses = model(tokens, labels=labels, mtp_tokens=targets["mtp_tokens"], mtp_labels=targets["mtp_labels"])
    assert losses.shape == (3, B, S)
    torch.testing.assert_close(losses[0], model(tokens, labels=labels))  # no MTP inputs: the main loss only
    rotary = rotary_tables(cfg, _positions(0, S))
    hidden = model.decoder(model.embedding(tokens), None, rotary)
    layer = model.mtp.layers[0]
    x = layer.eh_proj(torch.cat([layer.enorm(model.embedding(roll_left(tokens, 1))), layer.hnorm(hidden)], -1))
    out = layer.final_layernorm(layer.transformer_layer(x, None, rotary, True))
    logits = model.output_layer(out)[..., :50]
    expected = F.cross_entropy(logits.transpose(0, 1).reshape(-1, 50), roll_left(labels, 1).reshape(-1),
                               reduction="none").view(B, S)
    torch.testing.assert_close(losses[1], expected, rtol=1e-5, atol=1e-5)
    assert model.mtp.layers[1].transformer_layer.layer_number == 4  # depth k is global layer num_layers + k


def _one_head_size_flash(q, k, v, dropout_p, softmax_scale, causal):
    """flash_attn_func's contract ``[b, s, n, d]`` with one head size d for q, k and v."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and dropout_p == 0.0, (q.shape, k.shape, v.shape)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                          enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)


def _one_head_size_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal):
    """flash_attn_varlen_func's contract: ``[tokens, n, d]`` cut at ``cu_seqlens``, one head size."""
    assert torch.equal(cu_q, cu_k) and int((cu_q[1:] - cu_q[:-1]).max()) == max_q == max_k
    bounds = cu_q.tolist()
    return torch.cat([_one_head_size_flash(q[None, a:e], k[None, a:e], v[None, a:e], dropout_p, softmax_scale,
                                           causal)[0] for a, e in zip(bounds[:-1], bounds[1:])])


@pytest.mark.parametrize("dv", [6, 12])
@pytest.mark.parametrize("documents", [False, True])
def test_flash_path_pads_to_one_head_size_and_equals_sdpa(dv, documents):
    """The flash-attn branch (dense, or variable-length for packed documents) with stand-in kernels
    that take one head size, as flash-attn's do: values narrower or wider than queries/keys."""
    config = SimpleNamespace(attention_dropout=0.0, softmax_scale=0.3, masked_softmax_fusion=True)
    attn = DotProductAttention(config, ParallelState(world_size=1, rank=0), 1)
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(S, B, 4, 8, generator=g), torch.randn(S, B, 2, 8, generator=g), torch.randn(S, B, 2, dv, generator=g)
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 2 + [2] * 7]) if documents else None
    attn.flash = None
    expected = attn(q, k, v, ids)
    calls = []
    record = lambda kernel: lambda *a, **kw: calls.append(kernel) or kernel(*a, **kw)  # noqa: E731
    attn.flash = (record(_one_head_size_flash), record(_one_head_size_varlen))
    attn._flash_applies = lambda q, m: True
    got = attn(q, k, v, ids)
    assert calls == [_one_head_size_varlen if documents else _one_head_size_flash] and got.shape == (S, B, 4 * dv)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("over, words", [
    (dict(rope_type="yarn", multi_latent_attention=False, position_embedding_type="learned_absolute"),
     "--rope-type yarn needs --position-embedding-type rope"),
    (dict(rope_type="yarn", multi_latent_attention=False, use_rope_scaling=True), "--rope-type yarn replaces"),
    (dict(position_embedding_type="learned_absolute"), "--multi-latent-attention needs --position-embedding-type rope"),
    (dict(num_query_groups=2), "does not take --group-query-attention"),
    (dict(qk_pos_emb_head_dim=5), "--qk-pos-emb-head-dim 5 must be even"),
    (dict(mtp_num_layers=0), "--mtp-num-layers 0 must be at least 1"),
    # depth S has no position with a token S + 1 ahead: its loss was 0 (mean of nothing) at every step
    (dict(mtp_num_layers=S), f"--mtp-num-layers {S} must be less than --seq-length {S}"),
    (dict(mtp_num_layers=S + 3), f"--mtp-num-layers {S + 3} must be less than --seq-length {S}"),
    # YaRN's correction range divides by beta and ln(base): a ZeroDivisionError / math domain error traceback
    (dict(beta_fast=0.0, beta_slow=0.0), "--beta-fast 0.0 and --beta-slow 0.0 must be positive"),
    (dict(beta_slow=0.0), "--beta-slow 0.0 must be positive"),
    (dict(beta_fast=-1.0), "--beta-fast -1.0 and"),
    (dict(beta_fast=1.0, beta_slow=32.0), "--beta-fast >= --beta-slow"),  # an inverted ramp, else
    (dict(rotary_base=1), "--rotary-base 1 must be above 1"),
])
def test_combinations_that_are_not_built_are_refused(over, words):
    with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
        make_config("dsv3", **over)


def test_the_deepest_accepted_mtp_depth_keeps_a_position():
    """--mtp-num-layers S - 1 is accepted: its last depth still predicts from the first position."""
    assert make_config("dsv3", mtp_num_layers=S - 1).mtp_num_layers == S - 1
    masks = mtp_targets(torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long), torch.ones(B, S),
                        S - 1)["mtp_loss_mask"]
    assert masks.sum(dim=-1)[:, 0].tolist() == list(range(S - 1, 0, -1))  # depth k: S - k positions
