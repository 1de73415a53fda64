"""Model-state bytes per parameter: what a built model, its gradient buffer and the optimizer hold
after one step, against :func:`model_state_bytes_per_param` (18 / 6 + 12/d for 16-bit params,
16 / 8 + 12/d for fp32: the distributed optimizer keeps an fp32 master shard even for fp32 params). The toy tensor-parallel MLP of test_optimizer.py at TP 1, DP 1 or 2; the
gradient buffer, the flat parameter buffer with the same layout and the masters' flat shard are padded
to a multiple of d, which is the only (stated) difference.
"""

import pytest
import torch

from megatron_lite.perf.model_state import measured_model_state_bytes, model_state_bytes_per_param
from tests.distributed.test_distrib_optimizer import _build, _step
from tests.harness import cached_state, run_ranks


def _measure(dp, dtype, distributed):
    state = cached_state(dp=dp) if dp > 1 else None
    if state is None:
        from megatron_lite.parallel.state import ParallelState
        state = ParallelState()
    model, opt = _build(state, dtype, distributed)
    _step(model, opt, state, 0)
    n = sum(p.numel() for p in model.parameters())
    return n, model.grad_buffer.numel(), measured_model_state_bytes([model], opt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_single_rank_bytes_per_parameter(dtype):
    n, padded, got = _measure(1, dtype, False)
    assert padded == n
    assert sum(got.values()) == model_state_bytes_per_param(dtype) * n == (18 if dtype == torch.bfloat16 else 16) * n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_distributed_optimizer_shards_the_optimizer_state(dtype):
    results = run_ranks(2, _measure, 2, dtype, True)
    n = results[0][0]
    per_param = model_state_bytes_per_param(dtype, "optim", 2)
    assert per_param == (6 + 6 if dtype == torch.bfloat16 else 8 + 6)
    optimizer_total = 0
    for _, padded, got in results:
        assert got["params"] == padded * torch.empty((), dtype=dtype).element_size()  # the flat buffer
        assert got["grads"] == padded * 4 and padded - n < 2  # padded to a multiple of d
        optimizer_total += got["optimizer"]
    # each rank owns half of the parameters' master (its flat shard, padding included) and moments
    assert optimizer_total == 12 * n + 4 * (padded - n)
    for _, padded, got in results:
        assert abs(sum(got.values()) - per_param * n) <= 10 * (padded - n) + 12
