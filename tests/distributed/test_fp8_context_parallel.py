"""FP8 GPT under context parallelism equals the one-process FP8 GPT (fp32, gloo ranks, two steps).

Under context parallelism every GEMM sees only its rank's two chunks of the sequence (sequence
parallelism, by contrast, all-gathers the sequence before each GEMM). Tensorwise (current) scaling
casts with ``fp8_max / amax`` of the tensor being cast, so the FP8 gemms must MAX-reduce their amaxes
over tensor x context parallelism (``tp_cp``): over TP only, each CP rank casts its half of the
sequence with its own scale, which the one process never does (measured: 0.1-0.2 of a gradient's largest value).
Delayed scaling's per-step update reduces over TP and then over DP x CP (as the training loop calls
it). The experts' amaxes go over ``expert_amax``: the copies of the same experts fed chunks of the same
micro-batches (unfolded: TP x CP; folded: see megatron_lite/parallel/expert_grid.py).

Sequence parallelism needs no more than TP: the GEMMs see the sequence all-gathered over TP (TP2 +
SP tensorwise equals one process at model level too). The block-scaled recipes reduce nothing: the
forward's and dgrad's blocks run along features (one token's values, the same on any layout); wgrad's
run along tokens, so CP (here 8 tokens per chunk, blocks of 32 or 128) cuts them differently from one
process, but their scales are powers of two, which leave every normal FP8 value's rounding unchanged:
mxfp8 and blockwise at CP2 equal one process to 1e-5 with partial token blocks.

Every rank builds the one-process model and the CP (x TP + SP) model from the same seed, in fp32, so
with the same scales only summation order differs: per-token losses of this rank's chunks and every
gradient (summed over CP; TP shards gathered) within 1e-5 of the reference's largest value, over two
steps of growing input scale (the second with learned delayed scales). The control, amaxes reduced
over TP only (the old wiring), misses that tolerance under tensorwise scaling. The MoE layers the
same way: each rank feeds its CP chunks (and TP shard) of its DP rank's micro-batch, the reference
all DP ranks' micro-batches at once; outputs, input gradients and the expert weights' gradients
(summed over the expert-DP copies) within 1e-5, on unfolded and folded layouts, one of them without
CP (TP4 + SP, whole experts over EP2: the same fault without context parallelism).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_lite.models import GPTModel
from megatron_lite.moe.layer import MoELayer
from megatron_lite.parallel.context import split_for_cp
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import all_reduce_sequence_parallel_grads, shard
from megatron_lite.precision.fp8 import fp8_gemms, update_fp8_scales
from tests.distributed.test_fp8_folded_experts import _run
from tests.distributed.test_gpt_model import _full
from tests.harness import cached_state, run_ranks
from tests.model_helpers import transformer_config
from tests.moe_helpers import moe_config
from tests.unit.test_gpt_model import make_config

B, VOCAB = 2, 100


def _model(cfg, state, recipe, **run):
    config = transformer_config(cfg, state, seed=9, fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=2,
                                fp8_amax_compute_algo="max", **run)
    return GPTModel(config, state)


def _step(model, tokens, labels, embed_scale):
    model.zero_grad()
    with torch.no_grad():  # a different activation magnitude per step, so delayed scales move
        model.embedding.word_embeddings.weight.mul_(embed_scale)
    loss = model(tokens, labels=labels)
    loss.sum().backward()
    with torch.no_grad():
        model.embedding.word_embeddings.weight.div_(embed_scale)
    return loss.detach()


def check_cp_fp8_gpt(cp, tp, recipe, seq, reduce_over_cp=True):
    state = cached_state(cp=cp, tp=tp)
    cfg = make_config("B", seq_length=seq)
    serial = _model(cfg, ParallelState(world_size=1, rank=0), recipe)
    model = _model(cfg, state, recipe, context_parallel_size=cp, sequence_parallel=tp > 1)
    if not reduce_over_cp:
        for g in fp8_gemms(model):
            g.amax_group = state.tp_group
    mine = lambda t: split_for_cp(t, 1, state.cp_rank, cp)  # noqa: E731
    worst = 0.0
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        tokens, labels = (torch.randint(0, VOCAB, (B, seq), generator=g) for _ in range(2))
        ref = _step(serial, tokens, labels, 1.0 + 3 * step)
        loss = _step(model, mine(tokens), mine(labels), 1.0 + 3 * step)
        worst = max(worst, ((loss - mine(ref)).abs().max() / ref.abs().max()).item())
        if tp > 1:
            all_reduce_sequence_parallel_grads(model.parameters(), state.tp_group)
        ref_params = dict(serial.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.clone()
            if cp > 1:
                dist.all_reduce(grad, group=state.cp_group)
            full, want = (_full(p, grad, state.tp_group, tp) if tp > 1 else grad), ref_params[name].grad
            worst = max(worst, ((full - want).abs().max() / want.abs().max()).item())
        update_fp8_scales(serial)
        update_fp8_scales(model, data_parallel_group=state.dp_cp_group)  # as the training loop calls it
    return worst


@pytest.mark.parametrize("cp, tp, recipe", [
    (2, 1, "tensorwise"), (2, 1, "delayed"), (2, 2, "tensorwise"),
    (2, 1, "mxfp8"), (2, 1, "blockwise"),  # wgrad's token blocks cut by CP chunks: power-of-two scales, same casts
    (1, 2, "tensorwise"),  # sequence parallelism: the GEMMs see the sequence all-gathered over TP
])
def test_fp8_gpt_equals_one_process(cp, tp, recipe):
    worst = max(run_ranks(cp * tp, check_cp_fp8_gpt, cp, tp, recipe, 16))
    assert worst < 1e-5, f"CP{cp} x TP{tp} FP8 {recipe} GPT differs from one process by {worst:.3g}"


def test_cp2_tensorwise_without_cp_amax_reduction_differs():
    worst = max(run_ranks(2, check_cp_fp8_gpt, 2, 1, "tensorwise", 16, False))
    assert worst > 1e-3, "control: each CP rank casting with its own scale should quantise differently"


# ---- experts: the copies of the same experts fed chunks of the same micro-batches share the scale

S_MOE, H_MOE = 8, 32


def check_cp_fp8_experts(cp, tp, ep, etp, recipe, reduce_amax=True):
    state = cached_state(cp=cp, tp=tp, ep=ep, etp=etp)
    ref = MoELayer(_moe_config(recipe), ParallelState(world_size=1, rank=0), 1)
    layer = MoELayer(_moe_config(recipe, tensor_model_parallel_size=tp, sequence_parallel=tp > 1, context_parallel_size=cp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp), state, 1)
    if not reduce_amax:  # the old wiring: the experts' tensor-parallel group only
        for g in fp8_gemms(layer):
            g.amax_group = state.etp_group if state.folded else state.tp_group
    first, local, worst = layer.experts.first_expert, layer.experts.num_local_experts, 0.0
    mine = lambda t: split_for_cp(t, 0, state.cp_rank, cp).chunk(tp, dim=0)[state.tp_rank]  # noqa: E731
    for step in range(2):
        gens = [torch.Generator().manual_seed(100 * step + d) for d in range(state.dp_size)]
        data = [(torch.randn(S_MOE, B, H_MOE, generator=g) * (1 + step), torch.randn(S_MOE, B, H_MOE, generator=g))
                for g in gens]
        want = _run(ref, torch.cat([x for x, _ in data], 1), torch.cat([dy for _, dy in data], 1))
        batch = slice(state.dp_rank * B, (state.dp_rank + 1) * B)
        got = list(_run(layer, *(mine(t) for t in data[state.dp_rank])))
        want = [mine(t[:, batch]) for t in want]
        for name in ("weight1", "weight2"):  # each copy's gradient of its tokens, summed over the copies
            p, full = getattr(layer.experts, name), getattr(ref.experts, name).grad[first:first + local]
            grad = p.grad.clone()
            if state.expert_dp_group is not None:
                dist.all_reduce(grad, group=state.expert_dp_group)
            got.append(grad)
            want.append(shard(full, p.partition_dim, state.etp_rank, state.etp_size, p.partition_stride))
        for a, b in zip(got, want):
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
        update_fp8_scales(ref)
        update_fp8_scales(layer, data_parallel_group=state.dp_cp_group, expert_data_parallel_group=state.expert_dp_group)
    return worst


def _moe_config(recipe, **parallel):
    return moe_config(hidden_size=H_MOE, num_attention_heads=4, moe_ffn_hidden_size=32, num_experts=4, swiglu=True,
                      init_method_std=0.05, fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=2, fp8_amax_compute_algo="max",
                      moe_grouped_gemm=True, **parallel)


# CP2 x TP2 + SP with experts split over TP (the unfolded grid: expert_amax = tp_cp); CP2 x TP2 + SP
# with whole experts over EP2 (folded: each expert's copies on the two CP ranks); CP2 x DP2 x EP2 (each
# expert fed both micro-batches' chunks on each CP rank); and without CP, TP4 + SP with whole experts
# over EP2 (folded: each expert's two copies are fed two TP ranks' sequence shards each, and had their
# own scales before: the ETP group was the amax group)
LAYOUTS = [(2, 2, 1, None), (2, 2, 2, 1), (2, 1, 2, None), (1, 4, 2, 1)]


@pytest.mark.parametrize("cp, tp, ep, etp", LAYOUTS)
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_experts_equal_one_process(cp, tp, ep, etp, recipe):
    worst = max(run_ranks(4, check_cp_fp8_experts, cp, tp, ep, etp, recipe))
    assert worst < 1e-5, f"CP{cp} FP8 {recipe} experts (TP{tp} EP{ep} ETP{etp}) differ from one process by {worst:.3g}"


@pytest.mark.parametrize("cp, tp, ep, etp", LAYOUTS)
def test_tensorwise_experts_without_the_copies_amax_reduction_differ(cp, tp, ep, etp):
    assert max(run_ranks(4, check_cp_fp8_experts, cp, tp, ep, etp, "tensorwise", False)) > 1e-3
