"""Activation bytes saved for backward per transformer layer, measured by the live-tensor tracker
(``MemoryTracker``: tensors saved for backward and alive when the forward returns), against Korthikanti et al.'s formulas (bf16 activations, dropout on, CPU), with every difference
stated and checked exactly:

- ``norm stats``: each LayerNorm keeps its mean and reciprocal std (2 values per token, bf16),
  which the formula leaves out: +2 norms x 2 x sb x 2 bytes.
- ``core attention`` (no recomputation): CPU attention with dropout (``cpu_core_attention``) on a
  CPU without bf16 units computes in fp32 and keeps Q, K, V at 4 bytes (12 sbh instead of 6); of
  the scores it keeps the fp32 softmax output and a boolean keep mask, 4 + 1 bytes: the formula's
  5 as^2 b (2 + 1 + 2). With bf16 units it computes in bf16: Q, K, V as in the formula, the scores
  at 2 + 1 bytes (the dropout output is recomputed in backward): -2 as^2 b.
- ``gathered GEMM inputs`` (sequence parallelism): the all-gathered input of the QKV and fc1
  GEMMs is kept at full sequence length (Megatron keeps the shard and all-gathers again in
  backward): +2 x 2sbh (1 - 1/t).
- full recomputation keeps exactly the layer input, 2 sbh/t (per-layer difference of 2- and
  1-layer stacks, so the final norm drops out).

A multi-latent-attention layer against :func:`mla_layer_bytes` has the same differences, with its
own shapes: the latent norms' statistics too, and the fp32 core attention's Q, K, V of
``a (dn + dr)``, ``a (dn + dr)`` and ``a dv`` channels.
"""

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.models.cpu_attention import compute_dtype
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.perf.activation_memory import (
    korthikanti_layer_bytes,
    mla_layer_bytes,
    saved_activation_bytes,
)
from tests.harness import cached_state, run_ranks
from tests.model_helpers import build_gpt

S, B, H, A = 32, 2, 64, 4
FP32_ATTENTION = compute_dtype(torch.bfloat16) == torch.float32  # no bf16 units on this CPU
SBH = S * B * H


def _measure(tp, recompute, layers=1, **mla):
    state = cached_state(tp=tp) if tp > 1 else None
    if state is None:
        from megatron_lite.parallel.state import ParallelState
        state = ParallelState()
    model_parallel_seed(1, state)
    cfg = ModelConfig(num_layers=layers, hidden_size=H, num_attention_heads=A, seq_length=S, max_position_embeddings=S,
                      vocab_size=128, attention_dropout=0.1, hidden_dropout=0.1, **mla)
    kw = {"recompute_granularity": recompute} if recompute else {}
    if recompute == "full":
        kw.update(recompute_method="uniform", recompute_num_layers=1)
    model = build_gpt(cfg, state, seed=1, params_dtype=torch.bfloat16, sequence_parallel=tp > 1, **kw)
    x = torch.randn(S // tp, B, H, dtype=torch.bfloat16, requires_grad=True)
    module = model.decoder if recompute == "full" else model.decoder.layers[0]
    return saved_activation_bytes(module, x)


def _explained(t, recompute):
    sp = t > 1
    extra = 2 * 2 * (S // t) * B * 2  # norm statistics (dropout keeps boolean masks: 1 byte, as in the formula)
    if sp:
        extra += 2 * 2 * SBH * (1 - 1 / t)  # gathered GEMM inputs
    if recompute is None:
        extra += (6 * SBH if FP32_ATTENTION else -2 * A * S * S * B) / t  # the CPU core attention
    return korthikanti_layer_bytes(S, B, H, A, t, sp, recompute) + extra


@pytest.mark.parametrize("recompute", [None, "selective"])
def test_one_layer_matches_formula_with_explained_differences(recompute):
    assert _measure(1, recompute) == _explained(1, recompute)


def test_full_recompute_keeps_only_the_layer_input():
    per_layer = _measure(1, "full", layers=2) - _measure(1, "full", layers=1)
    assert per_layer == korthikanti_layer_bytes(S, B, H, A, recompute="full") == 2 * SBH


@pytest.mark.parametrize("recompute", [None, "selective"])
def test_tensor_and_sequence_parallel_divides_by_t(recompute):
    for measured in run_ranks(2, _measure, 2, recompute):
        assert measured == _explained(2, recompute)


MLA = dict(position_embedding_type="rope", multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True)


@pytest.mark.parametrize("q_lora_rank", [None, 32])
@pytest.mark.parametrize("recompute", [None, "selective"])
def test_mla_layer_matches_formula_with_explained_differences(q_lora_rank, recompute):
    norms = 3 + (q_lora_rank is not None)  # the two layer norms and the latent norms
    extra = norms * 2 * S * B * 2  # norm statistics
    if recompute is None:
        qkv = A * (2 * (16 + 8) + 12)  # channels of Q, K and V per token
        extra += 2 * S * B * qkv if FP32_ATTENTION else -2 * A * S * S * B  # the CPU core attention
    formula = mla_layer_bytes(S, B, H, A, 1, False, recompute, q_lora_rank, 16, 16, 8, 12)
    assert _measure(1, recompute, q_lora_rank=q_lora_rank, **MLA) == formula + extra
