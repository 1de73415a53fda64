"""Sharding strategies on a toy model: exact model-state bytes, and ZeRO-3 never reads a freed weight.

The toy model has two units (``sharding_unit = True``: 72 parameters each) and a root head (36
parameters), so every bucket splits evenly over 2 or 4 ranks and the bytes a rank holds after one
step equal :func:`model_state_bytes_per_param` times the parameter count exactly, for every
strategy, dtype and data-parallel size. ZeRO-3 keeps each parameter as a view of its unit's
buffer, whose storage is empty between uses: a unit whose gather is switched off makes forward
fail, so no parameter is ever read ungathered; after forward and after backward every unit is
freed again.
"""

from fractions import Fraction

import pytest
import torch
from torch import nn

from megatron_lite.config import Config
from megatron_lite.models import GPTModel
from megatron_lite.optim import build_optimizer
from megatron_lite.parallel.data_parallel import finalize_model_grads
from megatron_lite.parallel.fsdp import FullyShardedDataParallel, wrap_for_data_parallel
from megatron_lite.perf.model_state import measured_model_state_bytes, model_state_bytes_per_param
from tests.harness import cached_state, run_in_new_process, run_ranks

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class _Block(nn.Module):
    sharding_unit = True

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _Toy(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 4)
        self.to(dtype)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(state, dtype, strategy):
    cfg = Config()
    cfg.parallel.data_parallel_sharding_strategy = strategy
    cfg.parallel.ddp_bucket_size = 10**6
    cfg.precision.bf16 = dtype == torch.bfloat16
    model = wrap_for_data_parallel(_Toy(dtype), state, cfg.parallel)
    return model, build_optimizer(cfg, [model], state)


def _step(model, opt, state):
    opt.zero_grad()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(state.dp_rank))
    opt.scale_loss(model(x.to(next(model.module.parameters()).dtype)).float().pow(2).mean()).backward()
    finalize_model_grads([model], state)
    return opt.step()


def _measure_all(dp, dtype):
    from megatron_lite.parallel.state import ParallelState

    state = cached_state(dp=dp) if dp > 1 else ParallelState()
    out = {}
    for strategy in STRATEGIES:
        model, opt = _build(state, dtype, strategy)
        ok, _ = _step(model, opt, state)
        assert ok
        out[strategy] = measured_model_state_bytes([model], opt)
    return out


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_measured_bytes_equal_the_formula(dp, dtype):
    n = 180
    for rank, measured in enumerate(run_ranks(dp, _measure_all, dp, dtype)):
        for strategy, got in measured.items():
            expected = model_state_bytes_per_param(dtype, strategy, dp) * n
            assert sum(got.values()) == expected, (rank, strategy, got, expected)
    p = torch.empty((), dtype=dtype).element_size()
    assert model_state_bytes_per_param(dtype, "optim_grads", dp) == p + Fraction(16, dp)
    assert model_state_bytes_per_param(dtype, "optim_grads_params", dp) == Fraction(p + 16, dp)


def _freed(model) -> bool:
    return all(b.full.untyped_storage().nbytes() == 0 for b in model.buckets)


def test_units_are_freed_between_uses_and_a_missing_gather_fails():
    from megatron_lite.parallel.state import ParallelState

    model, opt = _build(ParallelState(), torch.float32, "optim_grads_params")
    assert isinstance(model, FullyShardedDataParallel) and [u.name for u in model.units] == ["blocks.0", "blocks.1", "root"]
    assert _freed(model)
    out = model(torch.randn(2, 8))
    assert _freed(model)  # after forward: only the shards are held
    out.sum().backward()
    assert _freed(model)  # regathered for backward, freed once the unit's grads were reduced
    assert model.grad_shards.abs().sum() > 0
    model.units[1].enabled = False  # this unit is never gathered again: its weight must not be readable
    with pytest.raises(RuntimeError, match="storage|not allocated"):
        model(torch.randn(2, 8))


def print_freed_model() -> None:
    """In a process of its own: print a ZeRO-3 model whose units are freed, its parameters, then one
    gathered."""
    from megatron_lite.parallel.fsdp import ShardedParameter, full_params
    from megatron_lite.parallel.state import ParallelState

    model, _ = _build(ParallelState(), torch.float32, "optim_grads_params")
    model(torch.randn(2, 8)).sum().backward()
    assert _freed(model) and all(isinstance(p, ShardedParameter) for p in model.parameters())
    print(model)
    print(list(model.parameters()))
    for name, p in model.named_parameters():
        print(name, p, f"{p}", str(p))
    with full_params([model]):
        print("GATHERED", next(model.parameters()))


def test_printing_a_freed_zero3_model_and_its_parameters_never_crashes():
    # a new process: PyTorch's printer reading freed memory segfaulted (that must fail this test,
    # not kill the test runner); forked with torch already imported (tests/harness.py)
    code, stdout, stderr = run_in_new_process(print_freed_model)
    assert code == 0, stderr[-3000:]
    assert "FullyShardedDataParallel" in stdout
    freed, gathered = stdout.split("GATHERED", 1)
    assert freed.count("not gathered now") == 4 * 6  # the list, and each of the 6 parameters three times
    assert "tensor([" not in freed
    assert "Parameter containing" in gathered and "tensor([" in gathered  # the values while gathered


def test_gpt_units_and_a_layer_without_its_gather():
    from megatron_lite.config import ModelConfig
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.parallel.state import ParallelState
    from tests.model_helpers import transformer_config

    state = ParallelState()
    model_parallel_seed(3, state)
    names = {}
    for untie in (False, True):
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                          untie_embeddings_and_output_weights=untie)
        gpt = GPTModel(transformer_config(cfg, state), state, pre_process=True, post_process=True)
        model = FullyShardedDataParallel(gpt, state)
        names[untie] = [u.name for u in model.units]
        tokens = torch.randint(0, 64, (2, 8))
        model(tokens, labels=tokens).sum().backward()
        model.units[1].enabled = False
        with pytest.raises(RuntimeError, match="storage|not allocated"):
            model(tokens, labels=tokens)
    # tied: the embedding's weight is read by the output layer too, so it stays in the root
    assert names[False] == ["decoder.layers.0", "decoder.layers.1", "root"]
    assert names[True] == ["embedding", "decoder.layers.0", "decoder.layers.1", "output_layer", "root"]


def _prefetch_seen(overlap):
    state = cached_state(dp=2)
    cfg = Config()
    cfg.parallel.data_parallel_sharding_strategy = "optim_grads_params"
    cfg.parallel.overlap_grad_reduce = cfg.parallel.overlap_param_gather = overlap
    model = wrap_for_data_parallel(_Toy(torch.float32), state, cfg.parallel)
    seen = []
    model.units[0].module.register_forward_pre_hook(lambda m, a: seen.append(bool(model.units[1].pending)))
    model(torch.randn(2, 8)).sum().backward()
    model.finish_grad_sync()
    return seen, _freed(model)


def test_overlap_param_gather_starts_the_next_units_gather_early():
    """With --overlap-param-gather the second unit's all-gather is in flight while the first unit's
    forward starts; without it nothing is started ahead."""
    for overlap in (True, False):
        for seen, freed in run_ranks(2, _prefetch_seen, overlap):
            assert seen == [overlap] and freed


def _load_inside_full_params():
    from megatron_lite.parallel.fsdp import full_params

    model, _ = _build(cached_state(dp=2), torch.float32, "optim_grads_params")
    g = torch.Generator().manual_seed(5)
    loaded = [torch.randn(p.shape, generator=g) for p in model.parameters()]
    with full_params([model], load=True), torch.no_grad():  # what a checkpoint load does
        for p, v in zip(model.parameters(), loaded):
            p.copy_(v)
    assert _freed(model)
    with full_params([model]):  # gathered again from the shards: the loaded values, every rank's chunk
        for p, v in zip(model.parameters(), loaded):
            assert torch.equal(p.detach(), v)


def test_values_loaded_into_gathered_zero3_params_are_kept_in_the_shards():
    run_ranks(2, _load_inside_full_params)


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_zero3_fp8_keeps_no_quantised_weight_of_a_freed_unit(recipe):
    """An FP8 gemm caches its quantised weight (and its dgrad operand) for the step's other
    micro-batches: a full-size copy per layer, as large as the bf16 weights ZeRO-3 shards. Freeing
    a unit drops it; the same micro-batches without ZeRO-3 keep it (the cache is there to drop).
    Block-scaled recipes cache theirs the same way."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.parallel.data_parallel import DistributedDataParallel
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.parallel.state import ParallelState
    from megatron_lite.precision.fp8 import fp8_gemms
    from tests.model_helpers import transformer_config

    state = ParallelState()
    cached = {}
    for wrap in (FullyShardedDataParallel, DistributedDataParallel):
        model_parallel_seed(3, state)
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64)
        model = wrap(GPTModel(transformer_config(cfg, state, fp8="hybrid", fp8_recipe=recipe), state, pre_process=True, post_process=True),
                     state)
        gemms = fp8_gemms(model)
        assert len(gemms) == 2 * 4
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        for _ in range(2):  # two micro-batches of one step
            model(tokens, labels=tokens).sum().backward()
            cached[wrap.__name__] = sum(g._weight_fp8 is not None for g in gemms)
    assert cached == {"FullyShardedDataParallel": 0, "DistributedDataParallel": 8}
