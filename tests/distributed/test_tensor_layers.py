"""Tensor-parallel layers against unsharded PyTorch references, on real gloo groups.

Every rank builds the full ("master") weight from a seeded generator, the same input and the
same output gradient; the reference is plain ``F.linear`` / ``F.embedding`` on the full tensors.
Each layer's output, input gradient and weight/bias gradients must equal this rank's part of the
reference. Tolerances: fp32 rtol 1e-5 (atol 1e-6); bf16 compared with the fp32 reference within
3e-2 of the reference's scale (bf16 keeps 8 bits of mantissa and sums in a different order).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.parallel.comm import group_rank, group_size
from megatron_lite.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_sequence_parallel_grads,
    normal_init,
    shard,
    unshard,
)
from tests.harness import cached_state, run_ranks

S, B, IN, OUT, VOCAB = 8, 2, 12, 16, 24


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(shape, seed):
    return torch.randn(shape, generator=_gen(seed))


def _master(shape, seed, std=0.02):
    w = torch.empty(shape)
    normal_init(std, _gen(seed))(w)
    return w


def _close(actual, expected, dtype, what):
    actual, expected = actual.float(), expected.float()
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
    else:
        scale = expected.abs().max().item() + 1e-6
        err = (actual - expected).abs().max().item()
        assert err <= 3e-2 * scale, f"{what}: max error {err:.3g} > 3e-2 x scale {scale:.3g}"


def _chunk(x, dim, group):
    return x.chunk(group_size(group), dim=dim)[group_rank(group)]


def check_column(tp, sp, dtype=torch.float32, stride=1):
    state = cached_state(tp=tp)
    g = state.tp_group
    layer = ColumnParallelLinear(
        IN, OUT, g, init_method=normal_init(0.02, _gen(1)), sequence_parallel=sp, stride=stride, dtype=dtype
    )
    with torch.no_grad():
        layer.bias.copy_(shard(_rand(OUT, 2), 0, state.tp_rank, tp, stride).to(dtype))
    w, b = _master((OUT, IN), 1), _rand(OUT, 2)
    x_full, dy_full = _rand((S, B, IN), 3), _rand((S, B, OUT), 4)
    x_ref = x_full.clone().requires_grad_()
    w_ref, b_ref = w.clone().requires_grad_(), b.clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref, b_ref)
    y_ref.backward(dy_full)

    x = (_chunk(x_full, 0, g) if sp else x_full).to(dtype).requires_grad_()
    y = layer(x)
    y.backward(shard(dy_full, 2, state.tp_rank, tp, stride).to(dtype))
    _close(y, shard(y_ref.detach(), 2, state.tp_rank, tp, stride), dtype, "output")
    _close(x.grad, _chunk(x_ref.grad, 0, g) if sp else x_ref.grad, dtype, "input grad")
    _close(layer.weight.grad, shard(w_ref.grad, 0, state.tp_rank, tp, stride), dtype, "weight grad")
    _close(layer.bias.grad, shard(b_ref.grad, 0, state.tp_rank, tp, stride), dtype, "bias grad")


def check_column_gather_output(tp):
    state = cached_state(tp=tp)
    layer = ColumnParallelLinear(IN, OUT, state.tp_group, init_method=normal_init(0.02, _gen(1)), gather_output=True)
    x = _rand((S, B, IN), 3)
    torch.testing.assert_close(layer(x), F.linear(x, _master((OUT, IN), 1), torch.zeros(OUT)), rtol=1e-5, atol=1e-6)


def check_row(tp, sp, dtype=torch.float32, input_is_parallel=True):
    state = cached_state(tp=tp)
    g = state.tp_group
    layer = RowParallelLinear(
        IN, OUT, g, init_method=normal_init(0.02, _gen(5)), sequence_parallel=sp,
        input_is_parallel=input_is_parallel, dtype=dtype,
    )
    with torch.no_grad():
        layer.bias.copy_(_rand(OUT, 6).to(dtype))
    w, b = _master((OUT, IN), 5), _rand(OUT, 6)
    x_full, dy_full = _rand((S, B, IN), 7), _rand((S, B, OUT), 8)
    x_ref = x_full.clone().requires_grad_()
    w_ref, b_ref = w.clone().requires_grad_(), b.clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref, b_ref)
    y_ref.backward(dy_full)

    x = (_chunk(x_full, 2, g) if input_is_parallel else x_full).to(dtype).requires_grad_()
    y = layer(x)
    y.backward((_chunk(dy_full, 0, g) if sp else dy_full).to(dtype))
    all_reduce_sequence_parallel_grads(layer.parameters(), g)
    _close(y, _chunk(y_ref.detach(), 0, g) if sp else y_ref.detach(), dtype, "output")
    _close(x.grad, _chunk(x_ref.grad, 2, g) if input_is_parallel else x_ref.grad, dtype, "input grad")
    _close(layer.weight.grad, _chunk(w_ref.grad, 1, g), dtype, "weight grad")
    _close(layer.bias.grad, b_ref.grad, dtype, "bias grad")


def check_embedding(tp, sp, dtype=torch.float32):
    state = cached_state(tp=tp)
    g = state.tp_group
    layer = VocabParallelEmbedding(VOCAB, OUT, g, init_method=normal_init(1.0, _gen(9)), sequence_parallel=sp, dtype=dtype)
    w = _master((VOCAB, OUT), 9, std=1.0)
    ids = torch.randint(0, VOCAB, (S, B), generator=_gen(10))
    dy = _rand((S, B, OUT), 11)
    w_ref = w.clone().requires_grad_()
    y_ref = F.embedding(ids, w_ref)
    y_ref.backward(dy)
    y = layer(ids)
    y.backward((_chunk(dy, 0, g) if sp else dy).to(dtype))
    _close(y, _chunk(y_ref.detach(), 0, g) if sp else y_ref.detach(), dtype, "output")
    _close(layer.weight.grad, _chunk(w_ref.grad, 0, g), dtype, "weight grad")


def check_unshard_roundtrip(tp):
    state = cached_state(tp=tp)
    full = _rand((OUT, IN), 12)
    part = shard(full, 0, state.tp_rank, tp, stride=2)
    parts = [torch.empty_like(part) for _ in range(tp)]
    torch.distributed.all_gather(parts, part, group=state.tp_group)
    torch.testing.assert_close(unshard(parts, 0, stride=2), full, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------

WORLDS = [(1, None), (2, 2), (4, 4)]  # (tp, world size of the rank pool; None = in-process)


def _run(world, fn, *args):
    if world is None:
        from megatron_lite.parallel.state import ParallelState

        assert args[0] == 1
        import tests.harness as h

        h._STATES.setdefault((("tp", 1),), ParallelState())
        return fn(*args)
    return run_ranks(world, fn, *args)


@pytest.mark.parametrize("tp, world", WORLDS)
@pytest.mark.parametrize("sp", [False, True])
def test_column_parallel_linear(tp, world, sp):
    _run(world, check_column, tp, sp)


@pytest.mark.parametrize("tp, world", WORLDS)
@pytest.mark.parametrize("sp", [False, True])
def test_row_parallel_linear(tp, world, sp):
    _run(world, check_row, tp, sp)


@pytest.mark.parametrize("tp, world", WORLDS)
@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding(tp, world, sp):
    _run(world, check_embedding, tp, sp)


def test_column_strided_and_gathered_and_unsharded():
    run_ranks(2, check_column, 2, False, torch.float32, 2)
    run_ranks(4, check_column_gather_output, 4)
    run_ranks(4, check_unshard_roundtrip, 4)


def test_row_parallel_with_full_input():
    run_ranks(4, check_row, 4, False, torch.float32, False)


@pytest.mark.parametrize("sp", [False, True])
def test_bf16_layers(sp):
    run_ranks(2, check_column, 2, sp, torch.bfloat16)
    run_ranks(2, check_row, 2, sp, torch.bfloat16)
    run_ranks(2, check_embedding, 2, sp, torch.bfloat16)


def check_indivisible(tp):
    g = cached_state(tp=tp).tp_group
    messages = []
    for build in (
        lambda: ColumnParallelLinear(4, 10, g),
        lambda: RowParallelLinear(10, 4, g),
        lambda: VocabParallelEmbedding(10, 4, g),
    ):
        with pytest.raises(ValueError) as err:
            build()
        messages.append(str(err.value))
    return messages


def test_indivisible_sizes_are_clear_errors():
    messages = run_ranks(4, check_indivisible, 4)[0]
    assert messages == [
        "ColumnParallelLinear's output size 10 is not divisible by --tensor-model-parallel-size 4 (the size of this "
        "layer's tensor-parallel group)",
        "RowParallelLinear's input size 10 is not divisible by --tensor-model-parallel-size 4 (the size of this "
        "layer's tensor-parallel group)",
        "padded vocabulary size 10 is not divisible by --tensor-model-parallel-size 4 (the size of this "
        "layer's tensor-parallel group)",
    ]
