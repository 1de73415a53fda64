"""Shared pieces of the inference tests: tiny GPT variants with random weights, saved as checkpoints.

Variants: ``gpt`` (learned positions, LayerNorm, GeLU, biases, tied, multi-head), ``rope_gqa``
(rotary, RMSNorm, SwiGLU, no biases, untied, 8 query heads over 4 key/value groups) and ``moe``
(rotary, 4 experts top-2 in every layer) and ``mla_mtp`` (DeepSeek-V3-shaped: multi-latent attention
with q compression, latent norms and YaRN, plus one multi-token prediction layer that generation
leaves unused: it decodes from the main head), ``qwen2`` (``rope_gqa`` with --add-qkv-bias), ``partial_rope`` (``rope_gqa`` with --rotary-percent 0.5),
``norm_1p`` (``rope_gqa`` with --apply-layernorm-1p), ``qk_norm`` (``rope_gqa`` with --qk-layernorm),
``rope_scaled`` (``rope_gqa`` with --use-rope-scaling and --rotary-seq-len-interpolation-factor 2),
``post_ln`` (``gpt`` with --apply-residual-connection-post-layernorm).
Every parameter, norms and biases included, is random
(:func:`randomize`), so a misplaced tensor changes the logits.
"""

import os

import torch

from megatron_lite.config import Config, ModelConfig
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.moe.config import MoEConfig, moe_fields
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import padded_vocab_size

VOCAB = 100  # NullTokenizer --vocab-size 99: ids 0..98 are text, 99 is the end of document
MAX_LEN = 96
VARIANTS = {
    "gpt": dict(num_attention_heads=4),
    "rope_gqa": dict(num_attention_heads=8, group_query_attention=True, num_query_groups=4,
                     position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                     untie_embeddings_and_output_weights=True),
    "moe": dict(num_attention_heads=4, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                disable_bias_linear=True),
    "mla_mtp": dict(num_attention_heads=4, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8,
                    qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True,
                    position_embedding_type="rope", rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.8,
                    mscale_all_dim=0.5, original_max_position_embeddings=24, normalization="RMSNorm", swiglu=True,
                    disable_bias_linear=True, untie_embeddings_and_output_weights=True, mtp_num_layers=1),
}
VARIANTS["qwen2"] = dict(VARIANTS["rope_gqa"], add_qkv_bias=True)  # rope_gqa with a bias on the QKV projection
VARIANTS["partial_rope"] = dict(VARIANTS["rope_gqa"], rotary_percent=0.5)  # half of each head rotates
VARIANTS["norm_1p"] = dict(VARIANTS["rope_gqa"], apply_layernorm_1p=True)  # norms scale by 1 + weight
VARIANTS["qk_norm"] = dict(VARIANTS["rope_gqa"], qk_layernorm=True)  # Qwen3's per-head q/k norms (before RoPE)
VARIANTS["rope_scaled"] = dict(VARIANTS["rope_gqa"], rotary_base=500000, use_rope_scaling=True,
                               rotary_seq_len_interpolation_factor=2)  # Llama 3.1 scaling, positions / 2
VARIANTS["attn_flags"] = dict(VARIANTS["rope_gqa"], rotary_interleaved=True, softmax_scale=0.2, attention_output_gate=True,
                              no_rope_freq="2")  # models/attention_config.py: layers 2 and 4 without rotary
VARIANTS["post_ln"] = dict(VARIANTS["gpt"], apply_residual_connection_post_layernorm=True)  # residuals from the norms
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_token_dispatcher_type="alltoall",
           moe_expert_capacity_factor=1.0)  # the capacity must not drop tokens at inference


GPT2_FILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "gpt2")
GPT2_TOKENIZER = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=os.path.join(GPT2_FILES, "vocab.json"),
                      merge_file=os.path.join(GPT2_FILES, "merges.txt"))
GPT2_VOCAB = 50257



def tiny_sentencepiece(folder: str, texts: list[str]):
    """A SentencePiece BPE tokenizer (vocabulary 600) trained on the tiny GPT-2 fixture corpus and ``texts``
    (each twice), saved under ``folder``: word starts joined in context, byte fallback for what it lacks."""
    import json

    from megatron_lite.data.tokenizers import build_tokenizer
    from tests.tools import load_tool

    with open(os.path.join(os.path.dirname(GPT2_FILES), "tiny_corpus.jsonl"), encoding="utf-8") as f:
        corpus = [json.loads(line)["text"] for line in f]
    model = load_tool("train_tokenizer").train_sentencepiece(corpus * 2 + list(texts) * 2, os.path.join(folder, "tiny"),
                                                             vocab_size=600, model_type="bpe")
    return build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)

def model_config(variant: str, vocab: int = VOCAB) -> ModelConfig:
    cfg = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=48, seq_length=MAX_LEN,
                      max_position_embeddings=MAX_LEN, vocab_size=vocab, make_vocab_size_divisible_by=8,
                      attention_dropout=0.0, hidden_dropout=0.0, **VARIANTS[variant])
    cfg.padded_vocab_size = padded_vocab_size(vocab, 8, 1)
    return cfg


def run_config(variant: str, root: str | None = None, ckpt_format: str = "torch", tokenizer: dict | None = None,
               vocab: int | None = None) -> Config:
    """The run's config; ``tokenizer``: DataConfig tokenizer fields (default NullTokenizer over VOCAB ids);
    ``vocab``: the model's vocabulary (default GPT2_VOCAB with GPT-2's tokenizer, else VOCAB)."""
    tokenizer = tokenizer or {"tokenizer_type": "NullTokenizer"}
    vocab = vocab or (GPT2_VOCAB if tokenizer["tokenizer_type"] == "GPT2BPETokenizer" else VOCAB)
    config = Config(model=model_config(variant, vocab))
    if variant == "moe":
        config.moe = MoEConfig(**MOE)
    for key, value in tokenizer.items():
        setattr(config.data, key, value)
    config.checkpoint.save = root
    config.checkpoint.ckpt_format = ckpt_format
    return config


def randomize(model, seed: int) -> None:
    """Random weights at unit activation scale (std 1/sqrt(fan-in)); norm weights 1 + N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            elif p.dim() == 1 or "word_embeddings" in name or "position_embeddings" in name:
                p.copy_(0.5 * noise if p.dim() > 1 else 0.1 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def build_model(variant: str, seed: int = 11, tokenizer: dict | None = None, vocab: int | None = None) -> GPTModel:
    """A single-process model of ``variant`` with random weights (eval mode)."""
    config = run_config(variant, tokenizer=tokenizer, vocab=vocab)
    moe = moe_fields(config.moe) if variant == "moe" else {}
    state = ParallelState(world_size=1, rank=0)
    model = GPTModel(TransformerConfig.from_model(config.model, **moe), state)
    randomize(model, seed)
    return model.eval()


def mtp_model(variant: str, depths: int, seed: int = 5) -> GPTModel:
    """A 2-layer model of ``variant`` with ``depths`` multi-token prediction depths, random weights
    (speculative decoding's drafts)."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, seq_length=MAX_LEN,
                      max_position_embeddings=MAX_LEN, vocab_size=VOCAB, make_vocab_size_divisible_by=8,
                      attention_dropout=0.0, hidden_dropout=0.0, **dict(VARIANTS[variant], mtp_num_layers=depths))
    cfg.padded_vocab_size = padded_vocab_size(VOCAB, 8, 1)
    model = GPTModel(TransformerConfig.from_model(cfg), ParallelState(world_size=1, rank=0))
    randomize(model, seed)
    return model.eval()


def save_model(variant: str, root: str, ckpt_format: str = "torch", seed: int = 11,
               tokenizer: dict | None = None, vocab: int | None = None, adjust=None) -> GPTModel:
    """Save :func:`build_model` (``adjust(model)`` applied to it first) as a one-process checkpoint
    under ``root``; returns the model."""
    from megatron_lite.checkpoint import save_checkpoint

    model = build_model(variant, seed, tokenizer, vocab)
    if adjust is not None:
        adjust(model)
    save_checkpoint(1, [model], None, None, 0, run_config(variant, root, ckpt_format, tokenizer, vocab),
                    ParallelState(world_size=1, rank=0))
    return model


def prefer_ids_from(model, size: int) -> None:
    """Make the ids from ``size`` on the most likely ones at every position (the tokenizer-less ids
    of a model vocabulary larger than its tokenizer's): the final norm adds a fixed direction that
    their (tied) output rows follow."""
    with torch.no_grad():
        e = torch.nn.functional.normalize(torch.randn(32, generator=torch.Generator().manual_seed(3)), dim=0)
        model.decoder.final_norm.bias.copy_(10 * e)
        model.embedding.word_embeddings.weight[size:].copy_(20 * e)


def prompts(batch: int = 3, seed: int = 0, lengths=(5, 9, 7)) -> list[list[int]]:
    """Prompts of different lengths, ids in the text range (never the end of document)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(batch)]


def assert_close(actual, expected, rtol: float = 1e-5, what: str = "") -> None:
    """Within ``rtol`` of the largest magnitude in ``expected`` (fp32 logits and log-probs whose
    sums differ only in order)."""
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale,
                               msg=(lambda m: f"{what}: {m}") if what else None)


# The chat template of the server tests: each message's content and a space, then token 7 to answer.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}"


def served_gpt():
    """Flask's test client of the one-at-a-time server over the "gpt" variant (NullTokenizer, the
    chat template above), and its engine."""
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.engine import InferenceEngine
    from megatron_lite.inference.server import Runner, create_app

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    engine = InferenceEngine(build_model("gpt"), vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod)
    return create_app(Runner(engine), tokenizer, chat_template=CHAT_TEMPLATE).test_client(), engine


def openai_client(app):
    """OpenAI's own Python client (skips without it) talking to the Flask ``app`` in-process, and
    the ``openai`` module."""
    import importlib

    import pytest

    openai = pytest.importorskip("openai")
    # the HTTP library this client version is built on (httpx, or its fork httpx2), for its WSGI transport
    httpx = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])
    return openai, openai.OpenAI(base_url="http://server/v1", api_key="none", max_retries=0,
                                 http_client=httpx.Client(transport=httpx.WSGITransport(app=app)))


def assert_json_close(got, want, where=""):
    """Equal JSON, floats within 1e-5 (fp32 log-probs whose attention sums ran in another order)."""
    if isinstance(want, float):
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_json_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_json_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, where
