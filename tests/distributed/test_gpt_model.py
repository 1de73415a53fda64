"""Tensor- (and sequence-) parallel GPTModel equals the single-process GPTModel, on real gloo groups.

Every rank builds the single-process model (group of one) and the TP model from the same seed
and runs the same batch. Compared: the initial weights (each TP shard gathered and unsharded
must equal the full weight exactly), the per-token loss, and every parameter gradient (TP grads
gathered with ``unshard``; replicated norm / bias / position-embedding grads after
``all_reduce_sequence_parallel_grads``). fp32, rtol 1e-5, atol 1e-6 for losses and 1e-7 for
gradients (gradients are ~1e-4..1e-2; only the summation order differs). Dropout is 0 so the
two computations are the same function; test_gpt_model.py in unit/ covers dropout under recompute.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_lite.models import GPTModel
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import all_reduce_sequence_parallel_grads, unshard
from tests.harness import cached_state, run_ranks
from tests.unit.test_gpt_model import make_batch, make_config


def _gather(t, group, tp):
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _full(p, t, group, tp):
    """The full tensor behind this rank's shard ``t`` of parameter ``p`` (replicated: ``t`` itself)."""
    if not getattr(p, "tensor_model_parallel", False):
        return t
    return unshard(_gather(t, group, tp), p.partition_dim, getattr(p, "partition_stride", 1))


def check_tp_equals_serial(tp, sp, variant, recompute=None):
    state = cached_state(tp=tp)
    g = state.tp_group
    cfg = make_config(variant)
    tokens, labels = make_batch(4)

    serial = GPTModel(cfg, ParallelState(world_size=1, rank=0), seed=9)
    loss_ref = serial(tokens, labels=labels)
    loss_ref.mean().backward()

    rec = dict(recompute_granularity=recompute[0], recompute_method=recompute[1], recompute_num_layers=recompute[2]) \
        if recompute else {}
    model = GPTModel(cfg, state, seed=9, sequence_parallel=sp, **rec)
    loss = model(tokens, labels=labels)
    loss.mean().backward()
    all_reduce_sequence_parallel_grads(model.parameters(), g)

    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    ref_params = dict(serial.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), "same parameter names as the single-process model"
    sp_marked = []
    for name, p in model.named_parameters():
        ref = ref_params[name]
        torch.testing.assert_close(_full(p, p.detach(), g, tp), ref.detach(), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"initial weight {name}: {m}")
        torch.testing.assert_close(_full(p, p.grad, g, tp), ref.grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"grad {name}: {m}")
        if getattr(p, "sequence_parallel", False):
            sp_marked.append(name)
    return sorted(sp_marked)


CASES = [(tp, sp, v) for tp in (2, 4) for sp in (False, True) for v in ("A", "B")]


@pytest.mark.parametrize("tp, sp, variant", CASES)
def test_tensor_parallel_equals_single_process(tp, sp, variant):
    marked = run_ranks(tp, check_tp_equals_serial, tp, sp, variant)[0]
    if not sp:
        assert marked == []
    else:  # every replicated parameter that sees only a sequence shard is marked, and nothing else
        expect = {"decoder.final_norm.weight"}
        for i in range(2):
            expect |= {f"decoder.layers.{i}.{n}.weight" for n in ("input_norm", "pre_mlp_norm")}
            if variant == "A":
                expect |= {f"decoder.layers.{i}.{n}.bias" for n in
                           ("input_norm", "pre_mlp_norm", "self_attention.linear_proj", "mlp.linear_fc2")}
        if variant == "A":
            expect |= {"decoder.final_norm.bias", "embedding.position_embeddings.weight"}
        assert marked == sorted(expect)


def test_tensor_sequence_parallel_with_full_recompute():
    run_ranks(2, check_tp_equals_serial, 2, True, "B", ("full", "uniform", 1))
    run_ranks(2, check_tp_equals_serial, 2, True, "A", ("selective", None, None))


def check_bad_tp_shapes(tp):
    state = cached_state(tp=tp)
    messages = []
    for over in (dict(num_attention_heads=8, num_query_groups=2), dict(padded_vocab_size=130)):
        with pytest.raises(ValueError) as err:
            GPTModel(make_config("B", **over), state)
        messages.append(str(err.value))
    model = GPTModel(make_config("A"), state, sequence_parallel=True)
    with pytest.raises(ValueError) as err:
        model(torch.zeros(2, 6, dtype=torch.long))
    messages.append(str(err.value))
    return messages


def test_bad_tensor_parallel_shapes_are_clear_errors():
    assert run_ranks(4, check_bad_tp_shapes, 4)[0] == [
        "num-query-groups 2 is not divisible by tensor-model-parallel-size 4; every rank must hold whole key/value groups",
        "padded vocabulary size 130 is not divisible by tensor-model-parallel-size 4",
        "sequence parallelism needs the sequence length 6 divisible by tensor-model-parallel-size 4",
    ]
