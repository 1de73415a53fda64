"""GPTModel in one process, against an independent plain-PyTorch GPT written here.

The reference below uses only F.linear / F.scaled_dot_product_attention / F.layer_norm / complex
rotations on the model's state dict, reading the documented weight layouts (fused QKV
``[groups, (heads_per_group + 2) * head_dim, hidden]``, SwiGLU fc1 ``[gate; up]``), so a passing test
means the model computes a GPT, not merely that it agrees with itself. Tolerances: fp32,
rtol 1e-5 / atol 1e-6 for logits and losses (different summation order only), 1e-5 / 1e-7 for grads.
"""


import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.models import GPTModel
from megatron_lite.parallel.state import ParallelState
from tests.model_helpers import build_gpt, transformer_config

B, S, VOCAB = 2, 16, 100

# Variant A: learned positions, LayerNorm, GeLU, biases, tied output layer, multi-head.
# Variant B: rope, RMSNorm, SwiGLU, no biases, untied output layer, grouped-query (8 heads, 4 groups).
VARIANTS = {
    "A": dict(num_attention_heads=4, num_query_groups=4),
    "B": dict(num_attention_heads=8, num_query_groups=4, position_embedding_type="rope", normalization="RMSNorm",
              swiglu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=True),
}
VARIANTS["Q"] = dict(VARIANTS["B"], add_qkv_bias=True)  # Qwen2's: B with a bias on the QKV projection only
VARIANTS["P"] = dict(VARIANTS["B"], rotary_percent=0.5)  # B rotating the first half of each head only
VARIANTS["N"] = dict(VARIANTS["A"], apply_layernorm_1p=True)  # A with zero-centred LayerNorm weights (1 + w)
VARIANTS["K"] = dict(VARIANTS["B"], qk_layernorm=True)  # B with Qwen3's per-head RMSNorm of queries and keys
VARIANTS["L"] = dict(VARIANTS["A"], qk_layernorm=True)  # A with per-head LayerNorm (weight + bias) of q and k
VARIANTS["R"] = dict(VARIANTS["A"], apply_residual_connection_post_layernorm=True)  # A, residuals from the norms
VARIANTS["S"] = dict(VARIANTS["P"], rotary_base=500000, use_rope_scaling=True,  # P with Llama 3.1 scaling and
                     rotary_seq_len_interpolation_factor=2)  # positions / 2 (global positions under CP)
VARIANTS["X"] = dict(VARIANTS["A"], swiglu=True, untie_embeddings_and_output_weights=True,  # A with Xavier-uniform
                     init_method_xavier_uniform=True, embedding_init_method_std=0.05)  # linears, embeddings' own std


def make_config(variant="A", tp=1, dropout=0.0, **over) -> ModelConfig:
    kw = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, seq_length=S, vocab_size=VOCAB,
              padded_vocab_size=128, attention_dropout=dropout, hidden_dropout=dropout)
    kw.update(VARIANTS[variant])
    kw.update(over)
    cfg = ModelConfig(**kw)
    if cfg.position_embedding_type == "learned_absolute":
        cfg.max_position_embeddings = S
    return cfg


def make_batch(seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    return tokens, labels


# ---------------------------------------------------------------------------------------------
# The independent reference.


def _ref_norm(x, w, b, cfg):
    if cfg.normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, cfg.norm_epsilon)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_epsilon) * w


def _ref_rope(x, base):
    """x [b, heads, s, d]: rotate each (x_i, x_{i + d/2}) pair by pos * base^(-2i/d), as complex numbers."""
    d, s = x.shape[-1], x.shape[-2]
    theta = torch.arange(s, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def reference_logits(sd, cfg, tokens):
    """Logits [b, s, padded_vocab] of a plain GPT with the weights in state dict ``sd``."""
    b, s = tokens.shape
    nh, ng = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    d, hpg = cfg.hidden_size // nh, nh // ng
    x = sd["embedding.word_embeddings.weight"][tokens]
    if cfg.position_embedding_type == "learned_absolute":
        x = x + sd["embedding.position_embeddings.weight"][:s]
    for i in range(cfg.num_layers):
        p = lambda name, i=i: sd.get(f"decoder.layers.{i}.{name}")  # noqa: E731
        y = _ref_norm(x, p("input_norm.weight"), p("input_norm.bias"), cfg)
        post = cfg.apply_residual_connection_post_layernorm  # Megatron: the residual is the norm's output
        x = y if post else x
        qkv = F.linear(y, p("self_attention.linear_qkv.weight"), p("self_attention.linear_qkv.bias"))
        qkv = qkv.view(b, s, ng, hpg + 2, d)
        q = qkv[:, :, :, :hpg].reshape(b, s, nh, d).transpose(1, 2)
        k, v = (qkv[:, :, :, hpg + j].transpose(1, 2) for j in (0, 1))  # [b, ng, s, d]
        if cfg.qk_layernorm:  # each head's channels, one weight for all heads, before the rotation
            q, k = (_ref_norm(t, p(f"self_attention.{n}_layernorm.weight"), p(f"self_attention.{n}_layernorm.bias"), cfg)
                    for t, n in ((q, "q"), (k, "k")))
        if cfg.position_embedding_type == "rope":  # --rotary-percent: the first int(d x percent) channels rotate
            r = int(d * cfg.rotary_percent)
            q, k = (torch.cat([_ref_rope(t[..., :r], cfg.rotary_base), t[..., r:]], dim=-1) for t in (q, k))
        group_of_head = torch.arange(nh) // hpg
        a = F.scaled_dot_product_attention(q, k[:, group_of_head], v[:, group_of_head], is_causal=True)
        a = a.transpose(1, 2).reshape(b, s, nh * d)
        x = x + F.linear(a, p("self_attention.linear_proj.weight"), p("self_attention.linear_proj.bias"))
        y = _ref_norm(x, p("pre_mlp_norm.weight"), p("pre_mlp_norm.bias"), cfg)
        x = y if post else x
        h = F.linear(y, p("mlp.linear_fc1.weight"), p("mlp.linear_fc1.bias"))
        if cfg.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = gate * torch.sigmoid(gate) * up
        else:
            h = 0.5 * h * (1.0 + torch.erf(h / 2**0.5))
        x = x + F.linear(h, p("mlp.linear_fc2.weight"), p("mlp.linear_fc2.bias"))
    x = _ref_norm(x, sd["decoder.final_norm.weight"], sd.get("decoder.final_norm.bias"), cfg)
    w_out = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    return x @ w_out.t()


def _close(a, b, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant, groups", [("A", None), ("B", None), ("B", 1), ("A", 2), ("R", None)])
def test_matches_independent_reference(variant, groups):
    over = {} if groups is None else dict(num_query_groups=groups)
    cfg = make_config(variant, **over)
    model = build_gpt(cfg, ParallelState(), seed=7)
    tokens, labels = make_batch()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    ref = reference_logits(sd, cfg, tokens)
    logits = model(tokens)
    assert logits.shape == (B, S, 128)
    _close(logits, ref, "logits")
    loss = model(tokens, labels=labels)
    ref_loss = F.cross_entropy(ref[..., :VOCAB].reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    _close(loss, ref_loss.view(B, S), "per-token loss")
    assert 3.0 < loss.mean().item() < 6.0  # near log(100) for a fresh model: the comparison is not vacuous


@pytest.mark.parametrize("heads, groups", [(8, 8), (8, 4), (8, 1)])
def test_qkv_shapes_for_mha_gqa_mqa(heads, groups):
    cfg = make_config("B", num_attention_heads=heads, num_query_groups=groups)
    attn = build_gpt(cfg, ParallelState()).decoder.layers[0].self_attention
    d = cfg.hidden_size // heads
    assert attn.linear_qkv.weight.shape == ((heads + 2 * groups) * d, cfg.hidden_size)
    assert attn.linear_proj.weight.shape == (cfg.hidden_size, heads * d)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", ["A", "B", "K", "R"])
def test_pipeline_split_equals_full_model(variant):
    cfg = make_config(variant)
    tokens, labels = make_batch(1)
    full = build_gpt(cfg, ParallelState(), seed=3)
    full(tokens, labels=labels).mean().backward()

    first = build_gpt(cfg, ParallelState(), seed=3, post_process=False, layer_start=0, layer_end=1)
    last = build_gpt(cfg, ParallelState(), seed=3, pre_process=False, layer_start=1, layer_end=2)
    hidden = first(tokens)
    received = hidden.detach().requires_grad_()  # what a pipeline's p2p receive hands over
    last.set_input_tensor(received)
    loss = last(tokens, labels=labels)
    _close(loss, full(tokens, labels=labels), "loss")
    loss.mean().backward()
    hidden.backward(received.grad)

    want = _grads(full)
    got = {n: g for n, g in _grads(first).items()}
    got.update({n.replace("decoder.layers.0.", "decoder.layers.1."): g for n, g in _grads(last).items()
                if n.startswith("decoder.layers.")})
    got["decoder.final_norm.weight"] = last.decoder.final_norm.weight.grad
    if variant in ("A", "R"):  # tied: the last stage owns an identical copy; the training code sums the two grads
        assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
        assert last.shared_embedding_or_output_weight().shared_embedding
        got["embedding.word_embeddings.weight"] = got["embedding.word_embeddings.weight"] + last.output_layer.weight.grad
        got["decoder.final_norm.bias"] = last.decoder.final_norm.bias.grad
    else:
        assert last.shared_embedding_or_output_weight() is None
        got["output_layer.weight"] = last.output_layer.weight.grad
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name], name, atol=1e-7)


def test_padded_vocab_never_counts():
    cfg = make_config("A")
    model = build_gpt(cfg, ParallelState(), seed=1)
    tokens, labels = make_batch(3)
    loss = model(tokens, labels=labels)
    with torch.no_grad():
        model.embedding.word_embeddings.weight[VOCAB:] = 50.0  # huge logits in the padded tail
    loss_padded = model(tokens, labels=labels)
    _close(loss_padded, loss, "loss with a perturbed padded tail")
    loss_padded.sum().backward()
    assert model.embedding.word_embeddings.weight.grad[VOCAB:].abs().max() == 0


@pytest.mark.parametrize("variant", ["A", "B"])
def test_padded_size_does_not_change_the_model(variant):
    """The padded vocabulary grows with TP (--make-vocab-size-divisible-by x TP: 123 rows pad to 130 at
    TP1 and 140 at TP2 with 10): a model padded to more rows has the same real rows at init, the same
    loss and the same gradients (the TP tests compare at one padded size, so this closes the gap)."""
    models = {}
    for padded in (104, 160):
        model = build_gpt(make_config(variant, padded_vocab_size=padded), ParallelState(), seed=3)
        tokens, labels = make_batch(4)
        loss = model(tokens, labels=labels)
        loss.mean().backward()
        models[padded] = (model, loss.detach())
    (small, loss_small), (big, loss_big) = models[104], models[160]
    _close(loss_big, loss_small, "loss at another padded vocabulary size")
    big_params = dict(big.named_parameters())
    for name, p in small.named_parameters():
        q = big_params[name]
        rows = p.shape[0] if p.shape == q.shape else VOCAB  # a vocabulary table: its real rows
        torch.testing.assert_close(q.detach()[:rows], p.detach()[:rows], rtol=0, atol=0, msg=f"initial {name}")
        _close(q.grad[:rows], p.grad[:rows], f"grad {name}", atol=1e-7)


def test_eval_mode_disables_dropout_and_param_count():
    cfg = make_config("A", dropout=0.5)
    model = build_gpt(cfg, ParallelState()).eval()
    tokens, _ = make_batch()
    torch.testing.assert_close(model(tokens), model(tokens), rtol=0, atol=0)
    h, f, v, L = 32, 64, 128, 2
    per_layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    assert model.num_parameters() == v * h + S * h + L * per_layer + 2 * h


@pytest.mark.parametrize("over, message", [
    (dict(num_attention_heads=8, num_query_groups=3), "--num-attention-heads 8 is not divisible by --num-query-groups 3"),
    (dict(vocab_size=None, padded_vocab_size=None), "the model config has no vocabulary size: pass --vocab-size"),
    (dict(position_embedding_type="alibi"), "--position-embedding-type 'alibi'"),
    (dict(normalization="BatchNorm"), "--normalization 'BatchNorm'"),
    (dict(num_attention_heads=5), "--hidden-size 32 is not divisible by --num-attention-heads 5"),
    (dict(num_layers=2), "layer range [0, 3) is outside the model's 2 layers"),
])
def test_bad_shapes_are_clear_errors(over, message):
    cfg = make_config("A", **over)
    with pytest.raises(ValueError) as err:
        build_gpt(cfg, ParallelState(), layer_end=3 if "num_layers" in over else None)
    assert message in str(err.value)


def test_rope_odd_head_dim_and_long_positions_are_clear_errors():
    with pytest.raises(ValueError, match="rope needs an even head dimension"):
        build_gpt(make_config("B", kv_channels=5), ParallelState())
    model = build_gpt(make_config("A"), ParallelState())
    with pytest.raises(ValueError, match="raise --max-position-embeddings"):
        model(torch.zeros(1, S + 1, dtype=torch.long))


def test_explicit_masks():
    """A causal bool mask equals the implicit causal path; a block-diagonal (reset-attention-mask) one
    makes the second document independent of the first."""
    cfg = make_config("B")
    model = build_gpt(cfg, ParallelState(), seed=2)
    tokens, _ = make_batch(5)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).expand(B, 1, S, S)
    _close(model(tokens, attention_mask=causal), model(tokens), "explicit causal mask")
    block = causal.clone()
    block[:, :, S // 2 :, : S // 2] = True  # second half may not see the first half
    position_ids = torch.cat([torch.arange(S // 2), torch.arange(S // 2)]).expand(B, S)
    changed = tokens.clone()
    changed[:, : S // 2] = (changed[:, : S // 2] + 1) % VOCAB
    out = model(tokens, position_ids=position_ids, attention_mask=block)[:, S // 2 :]
    out_changed = model(changed, position_ids=position_ids, attention_mask=block)[:, S // 2 :]
    _close(out_changed, out, "second document under a block mask")
    second_alone = model(tokens[:, S // 2 :])
    _close(out, second_alone, "second document == the same tokens on their own")


def test_bidirectional_block_for_bert():
    """attn_mask_type='padding' without a mask attends both ways: a late token changes early outputs."""
    from megatron_lite.models import LayerSpec, TransformerBlock

    cfg = make_config("A")
    hidden = torch.randn(S, B, cfg.hidden_size)
    outs = {}
    for kind in ("causal", "padding"):
        block = TransformerBlock(transformer_config(cfg, ParallelState(), seed=1), ParallelState(), LayerSpec(),
                                 attn_mask_type=kind)
        changed = hidden.clone()
        changed[-1] += torch.randn(B, cfg.hidden_size)  # (a constant shift would vanish in LayerNorm)
        outs[kind] = (block(hidden)[0] - block(changed)[0]).abs().max().item()
    assert outs["causal"] == 0 and outs["padding"] > 1e-4


def test_bf16_close_to_fp32():
    cfg = make_config("B")
    tokens, labels = make_batch(6)
    loss32 = build_gpt(cfg, ParallelState(), seed=4)(tokens, labels=labels)
    model16 = build_gpt(cfg, ParallelState(), seed=4, params_dtype=torch.bfloat16)
    assert model16.decoder.layers[0].mlp.linear_fc1.weight.dtype == torch.bfloat16
    loss16 = model16(tokens, labels=labels)
    assert loss16.dtype == torch.float32  # the loss is computed in fp32
    loss16.mean().backward()
    assert (loss16 - loss32).abs().max() < 0.05  # bf16 keeps ~3 significant digits


def test_gemm_seam_carries_every_linear():
    """Every parallel linear, including the tied output layer, computes through its ``gemm``."""
    from megatron_lite.models import TransformerConfig

    calls = []

    class Counting(TransformerConfig):
        def make_gemm(self, layer_number, tp_group=None):
            def gemm(x, weight, bias=None):
                calls.append(layer_number)
                return F.linear(x, weight, bias)
            return gemm

    cfg = Counting.from_model(make_config("A"), seed=2)
    model = GPTModel(cfg, ParallelState())
    reference = GPTModel(TransformerConfig.from_model(make_config("A"), seed=2), ParallelState())
    tokens, _ = make_batch(9)
    _close(model(tokens), reference(tokens), "logits through counting GEMMs")
    assert sorted(calls) == [0] + [1] * 4 + [2] * 4  # the tied output layer (0: outside the layers); qkv, proj, fc1, fc2 per layer
