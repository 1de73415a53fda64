"""BertModel in one process, against an independent plain-PyTorch pre-LayerNorm BERT written here (also in
the --apply-residual-connection-post-layernorm order: each residual add takes the norm's output).

The reference reads the model's state dict and uses only F.linear / F.layer_norm / softmax with an
explicit additive key mask, so a passing test means the model computes Megatron's BERT (pre-LN
layers, final norm, LM head dense -> GeLU -> LayerNorm -> tied output + bias, pooler tanh on [CLS],
binary head), not merely that it agrees with itself. Tolerances: fp32, rtol 1e-5 / atol 1e-6 for
logits and losses, rtol 1e-5 / atol 1e-6 x the tensor's largest entry for gradients (different
summation order only).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.models import BertModel, TransformerConfig
from megatron_lite.models.bert import bert_attention_mask
from megatron_lite.parallel.state import ParallelState

B, S, VOCAB, H, HEADS, LAYERS = 2, 16, 100, 32, 4, 2


def make_config(**over) -> TransformerConfig:
    kw = dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=64, seq_length=S,
              vocab_size=VOCAB, padded_vocab_size=128, attention_dropout=0.0, hidden_dropout=0.0, seed=7)
    kw.update(over)
    return TransformerConfig(**kw)


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    types = torch.zeros(B, S, dtype=torch.long)
    types[:, 7:] = 1
    padding = torch.ones(B, S, dtype=torch.long)
    padding[1, 11:] = 0  # the second sample is padded: its last 5 positions must not be attended to
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    return tokens, types, padding, labels


# ---------------------------------------------------------------------------------------------
# The independent reference.


def _ln(x, sd, name, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), sd[f"{name}.weight"], sd[f"{name}.bias"], eps)


def _attention(y, sd, p, padding):
    """Multi-head self-attention with the fused QKV layout [heads, (q, k, v), d, hidden] (one group per head)."""
    b, s, _ = y.shape
    d = H // HEADS
    qkv = F.linear(y, sd[p + "self_attention.linear_qkv.weight"], sd[p + "self_attention.linear_qkv.bias"])
    qkv = qkv.view(b, s, HEADS, 3, d)
    q, k, v = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))  # [b, heads, s, d]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores + torch.where(padding[:, None, None, :] > 0, 0.0, float("-inf"))
    a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, H)
    return F.linear(a, sd[p + "self_attention.linear_proj.weight"], sd[p + "self_attention.linear_proj.bias"])


def reference(sd, tokens, types, padding, binary_head=True, post_ln=False):
    """(logits [b, s, padded_vocab], binary logits [b, 2] or None) of a plain pre-LN BERT; ``post_ln``:
    each residual add takes the norm's output (--apply-residual-connection-post-layernorm)."""
    x = sd["embedding.word_embeddings.weight"][tokens] + sd["embedding.position_embeddings.weight"][: tokens.shape[1]]
    if binary_head:
        x = x + sd["embedding.tokentype_embeddings.weight"][types]
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        y = _ln(x, sd, p + "input_norm")
        x = (y if post_ln else x) + _attention(y, sd, p, padding)
        y = _ln(x, sd, p + "pre_mlp_norm")
        h = F.linear(y, sd[p + "mlp.linear_fc1.weight"], sd[p + "mlp.linear_fc1.bias"])
        h = 0.5 * h * (1.0 + torch.erf(h / 2**0.5))
        x = (y if post_ln else x) + F.linear(h, sd[p + "mlp.linear_fc2.weight"], sd[p + "mlp.linear_fc2.bias"])
    x = _ln(x, sd, "encoder.final_norm")
    t = F.linear(x, sd["lm_head.dense.weight"], sd["lm_head.dense.bias"])
    t = _ln(0.5 * t * (1.0 + torch.erf(t / 2**0.5)), sd, "lm_head.layer_norm")
    w_out = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    logits = t @ w_out.t() + sd["output_layer.bias"]
    if not binary_head:
        return logits, None
    pooled = torch.tanh(F.linear(x[:, 0], sd["pooler.dense.weight"], sd["pooler.dense.bias"]))
    return logits, F.linear(pooled, sd["binary_head.weight"], sd["binary_head.bias"])


def _close(a, b, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _perturb(model):
    """Non-trivial biases and norm weights (they start at 0 / 1, which would hide a missing term)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary_head, post_ln", [(True, False), (False, False), (True, True)])
def test_logits_and_every_gradient_match_reference(binary_head, post_ln):
    model = BertModel(make_config(apply_residual_connection_post_layernorm=post_ln), ParallelState(),
                      num_tokentypes=2 if binary_head else 0, add_binary_head=binary_head)
    _perturb(model)
    tokens, types, padding, labels = make_batch()
    sd = {k: v.detach().clone().requires_grad_() for k, v in model.state_dict().items()}
    ref_logits, ref_binary = reference(sd, tokens, types, padding, binary_head, post_ln)

    logits, binary = model(tokens, padding, types)
    assert logits.shape == (B, S, 128)
    _close(logits, ref_logits, "logits")
    if binary_head:
        _close(binary, ref_binary, "binary logits")
    else:
        assert binary is None and "binary_head.weight" not in sd and "embedding.tokentype_embeddings.weight" not in sd

    # loss = MLM over every position (weighted) + SOP: gradients of every parameter
    weights = torch.rand(B, S, generator=torch.Generator().manual_seed(1))
    order = torch.tensor([1, 0])
    lm_loss, binary = model(tokens, padding, types, lm_labels=labels)
    ref_lm = F.cross_entropy(ref_logits[..., :VOCAB].reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    _close(lm_loss, ref_lm.view(B, S), "per-token MLM loss")
    loss = (lm_loss * weights).sum() + (F.cross_entropy(binary.float(), order) if binary_head else 0)
    ref_loss = (ref_lm.view(B, S) * weights).sum() + (F.cross_entropy(ref_binary, order) if binary_head else 0)
    loss.backward()
    ref_loss.backward()
    grads = dict(model.named_parameters())
    assert set(grads) == set(sd)
    for name, p in grads.items():
        _close(p.grad, sd[name].grad, f"grad {name}", atol=1e-6 * sd[name].grad.abs().max().item())
        assert p.grad.abs().sum() > 0, name  # every parameter takes part


def test_padding_positions_do_not_change_real_outputs():
    model = BertModel(make_config(), ParallelState())
    tokens, types, padding, _ = make_batch()
    logits, binary = model(tokens, padding, types)
    other = tokens.clone()
    other[1, 11:] = (other[1, 11:] + 17) % VOCAB  # different ids behind the padding
    logits2, binary2 = model(other, padding, types)
    torch.testing.assert_close(logits[1, :11], logits2[1, :11], rtol=0, atol=0)
    torch.testing.assert_close(binary, binary2, rtol=0, atol=0)
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits[1, 11:], logits2[1, 11:])  # the padded positions did change


def test_attention_mask_masks_padding_keys():
    padding = torch.tensor([[1, 1, 0]])
    mask = bert_attention_mask(padding)
    assert mask.shape == (1, 1, 3, 3) and mask.dtype == torch.bool
    assert mask[0, 0].tolist() == [[False, False, True]] * 3
    assert bert_attention_mask(None) is None


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_pipeline_split_equals_full_model():
    cfg = make_config()
    tokens, types, padding, labels = make_batch(1)

    def loss_of(out):
        lm, binary = out
        return lm.mean() + F.cross_entropy(binary.float(), torch.tensor([0, 1]))

    full = BertModel(cfg, ParallelState())
    loss_of(full(tokens, padding, types, labels)).backward()
    first = BertModel(cfg, ParallelState(), post_process=False, layer_start=0, layer_end=1)
    last = BertModel(cfg, ParallelState(), pre_process=False, layer_start=1, layer_end=2)
    hidden = first(tokens, padding, types)
    received = hidden.detach().requires_grad_()
    last.set_input_tensor(received)
    loss = loss_of(last(tokens, padding, types, labels))
    loss.backward()
    hidden.backward(received.grad)

    assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
    assert last.shared_embedding_or_output_weight().shared_embedding
    want = _grads(full)
    got = _grads(first)
    for n, g in _grads(last).items():
        got[n.replace("encoder.layers.0.", "encoder.layers.1.")] = g
    got["embedding.word_embeddings.weight"] = got["embedding.word_embeddings.weight"] + got.pop("output_layer.weight")
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name], name, atol=1e-7)


def test_state_dict_names():
    names = set(BertModel(make_config(num_layers=1), ParallelState()).state_dict())
    assert {"embedding.tokentype_embeddings.weight", "encoder.final_norm.weight", "lm_head.dense.weight",
            "lm_head.layer_norm.weight", "output_layer.bias", "pooler.dense.weight", "binary_head.weight"} <= names
    assert "output_layer.weight" not in names  # tied to the word embedding
