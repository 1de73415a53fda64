"""Block-scaled FP8 (``blockwise``, ``mxfp8``) quantises each weight once per step, as delayed scaling does.

Two steps of three accumulated micro-batches: the weight is quantised once per step and operand
(``blockwise``: its 128 x 128 tiles; ``mxfp8``: along the input and along the output features),
not once per micro-batch, and every output, input gradient and weight gradient is bit-identical to
quantising on every call. Between the steps the weight is written the way the optimizers write it:
in place (a version bump) or through ``.data`` / a flat parameter buffer, which bumps no version, so
only the once-per-step ``update_fp8_scales`` drops the cache then. A checkpoint load re-quantises;
evaluation keeps nothing.
"""

import pytest
import torch

from megatron_lite.precision import fp8_block
from megatron_lite.precision.fp8 import Fp8Gemm, Fp8Recipe, update_fp8_scales

S, B, K, N = 6, 2, 64, 48
CASTS_PER_STEP = {"blockwise": 1, "mxfp8": 2}


def _rand(shape, seed, std=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def _count_weight_casts(monkeypatch) -> list:
    """Every quantize_blocks call on an (N, K) or (K, N) tensor: the weight or its transpose (no
    activation or gradient here has these shapes)."""
    calls, real = [], fp8_block.quantize_blocks

    def counting(t, block, recipe, dtype=fp8_block.E4M3):
        if tuple(t.shape) in ((N, K), (K, N)):
            calls.append((tuple(t.shape), block))
        return real(t, block, recipe, dtype)

    monkeypatch.setattr(fp8_block, "quantize_blocks", counting)
    return calls


def _accumulating_steps(gemm, w0, write, micro_batches=3, steps=2):
    w = w0.clone().requires_grad_()
    seen = []
    for step in range(steps):
        for mb in range(micro_batches):
            x = _rand((S, B, K), 10 + 7 * step + mb).requires_grad_()
            y = gemm(x, w)
            y.backward(_rand((S, B, N), 50 + 7 * step + mb, 1e-3))
            seen += [y.detach(), x.grad]
        update_fp8_scales(gemm)
        seen.append(w.grad.clone())
        new = w.detach() - 0.5 * w.grad
        if write == "in_place":
            with torch.no_grad():
                w.copy_(new)
        else:  # as the distributed optimizer through the flat buffer p.data views: no version bump
            w.data.copy_(new)
        w.grad = None
    return seen


@pytest.mark.parametrize("write", ["in_place", "data"])
@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_recipes_quantise_the_weight_once_per_step(recipe, write, monkeypatch):
    w0 = _rand((N, K), 2, 0.05)
    calls = _count_weight_casts(monkeypatch)
    cached = _accumulating_steps(Fp8Gemm(Fp8Recipe(recipe=recipe)), w0, write)
    per_step = CASTS_PER_STEP[recipe]
    assert len(calls) == 2 * per_step  # once per step (and operand), not once per micro-batch
    real = fp8_block.weight_blocks
    monkeypatch.setattr(fp8_block, "weight_blocks", lambda gemm, weight, record: real(gemm, weight, False))
    every_time = _accumulating_steps(Fp8Gemm(Fp8Recipe(recipe=recipe)), w0, write)
    assert len(calls) == 2 * per_step + 6 * per_step
    for a, b in zip(cached, every_time, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_a_loaded_weight_is_quantised_again_and_evaluation_caches_nothing(recipe):
    x, w = _rand((S, B, K), 1).requires_grad_(), torch.nn.Parameter(_rand((N, K), 2, 0.05))
    gemm = Fp8Gemm(Fp8Recipe(recipe=recipe))
    with torch.no_grad():
        gemm(x, w)
    assert gemm._weight_fp8 is None  # evaluation: nothing kept
    gemm(x, w)
    assert gemm._weight_fp8 is not None
    holder = torch.nn.Module()
    holder.weight = w
    holder.load_state_dict({"weight": _rand((N, K), 3, 0.5)})  # a checkpoint load: same storage, new values
    fresh = Fp8Gemm(Fp8Recipe(recipe=recipe))(x, w)
    assert torch.equal(gemm(x, w), fresh)
    gemm.drop_weight_cache()
    assert gemm._weight_fp8 is None


def _gpt_losses(recipe, steps=3, micro_batches=3):
    from megatron_lite.config import ModelConfig
    from megatron_lite.models.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.parallel.state import ParallelState
    from tests.model_helpers import transformer_config

    state = ParallelState()
    model_parallel_seed(3, state)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=64)
    config = transformer_config(cfg, state, fp8="hybrid", fp8_recipe=recipe, num_experts=4, moe_grouped_gemm=True,
                                moe_ffn_hidden_size=64, moe_token_dispatcher_type="alltoall")
    model = GPTModel(config, state, pre_process=True, post_process=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        for mb in range(micro_batches):
            tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + mb))
            loss = model(tokens, labels=tokens).mean()
            loss.backward()
            losses.append(loss.detach())
        update_fp8_scales(model)
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_gpt_with_fp8_experts_has_the_uncached_losses(recipe, monkeypatch):
    """Dense linears and grouped experts (views of one stacked weight) over three Adam steps."""
    cached = _gpt_losses(recipe)
    real = fp8_block.weight_blocks
    monkeypatch.setattr(fp8_block, "weight_blocks", lambda gemm, weight, record: real(gemm, weight, False))
    assert torch.equal(cached, _gpt_losses(recipe))
    assert cached[-1] < cached[0]
