"""The planner takes each pipeline stage's layers from training's split (pipeline_ranges): the
layout flags (--pipeline-model-parallel-layout, --account-for-embedding/loss-in-pipeline-split,
--decoder-first/last-pipeline-num-layers); per-stage parameters equal the built chunks', the peak
memory is on the stage the split loads most, the busiest stage paces the step, the search proposes
the account flags where PP does not divide the layers, and tools/plan.py takes the flags (and the
upcycling ones, which change nothing) or refuses them in training's words."""

import dataclasses
import os
import sys

import pytest

from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.pipeline.partition import pipeline_ranges
from megatron_lite.parallel.state import ParallelState
from megatron_lite.perf.flops import num_floating_point_operations
from megatron_lite.perf.plan import ClusterSpec, Layout, ModelSpec, estimate, plan, stage_params
from megatron_lite.perf.plan.estimate import held_layers, in_flight_microbatches, layer_bytes, stage_memory
from megatron_lite.perf.plan.split import rank_ranges, rank_work, split_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tools import plan as plan_tool  # noqa: E402

SHAPES = dict(num_layers=6, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
VARIANTS = {  # (ModelSpec fields, TransformerConfig fields)
    "gpt": ({}, {}),
    "llama": (dict(swiglu=True, add_bias_linear=False, learned_positions=False, untie_embeddings_and_output_weights=True),
              dict(swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                   untie_embeddings_and_output_weights=True)),
    "moe": (dict(num_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=2),
            dict(num_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=2)),
    "mtp": (dict(learned_positions=False, mtp_num_layers=1), dict(position_embedding_type="rope", mtp_num_layers=1)),
}
SPLITS = [  # Layout fields; the layouts name the MTP layer where the model has one
    dict(pp=4, pipeline_layout="E|ttt|tt|tL"),
    dict(pp=2, vpp=2, pipeline_layout="Et|tt|t|ttL"),  # rank 0: Et, t; rank 1: tt, ttL
    dict(pp=2, vpp=2, pipeline_layout="E|ttt|tt|tL"),  # rank 0's first chunk holds only the embedding
    dict(pp=4, account_embedding=True, account_loss=True),  # 1, 2, 2, 1
    dict(pp=2, vpp=2, account_embedding=True, account_loss=True),  # 8 slots, 2 per virtual stage
    dict(pp=3, first=1, last=1),  # 1, 4, 1
    dict(pp=4),  # the planner's own split of 6 over 4: 1, 2, 2, 1 (first and last smaller)
]


def _with_mtp(split: dict, mtp: int) -> dict:
    text = split.get("pipeline_layout")
    return {**split, "pipeline_layout": text[:-1] + "m" * mtp + "L"} if text and mtp else split


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stage_parameters_of_a_split_equal_the_built_chunks(variant, split):
    """Every rank's planned parameters equal its chunks built as training builds them (the embedding on
    rank 0's first chunk, the output layer and MTP on the last rank's last chunk), for every split."""
    spec_fields, config_fields = VARIANTS[variant]
    spec = ModelSpec(**SHAPES, **spec_fields)
    config = TransformerConfig(max_position_embeddings=16, **SHAPES, **config_fields)
    lay = Layout(**_with_mtp(split, spec.mtp_num_layers))
    ranges = rank_ranges(spec, lay)
    p = lay.pp
    for r, chunks in enumerate(ranges):
        built = sum(GPTModel(config, ParallelState(), pre_process=r == 0 and c == 0,
                             post_process=r == p - 1 and c == len(chunks) - 1, layer_start=lo,
                             layer_end=hi).num_parameters() for c, (lo, hi) in enumerate(chunks))
        assert sum(stage_params(spec, 1, p, 1, r == 0, r == p - 1, r, None, chunks)) == built, (r, chunks)


def test_the_split_is_trainings():
    """The ranges are pipeline_ranges' of the same flags (no copy of the rule)."""
    spec = ModelSpec(**SHAPES)
    for split in SPLITS:
        lay = Layout(**split)
        fields = {f: getattr(lay, f) for f in ("pipeline_layout", "first", "last", "account_embedding", "account_loss")}
        expected = pipeline_ranges(split_config(6, 0, lay.pp, lay.vpp, fields))
        assert [list(chunks) for chunks in rank_ranges(spec, lay)] == expected
    assert rank_ranges(spec, Layout(pp=4, account_embedding=True, account_loss=True)) == (
        ((0, 1),), ((1, 3),), ((3, 5),), ((5, 6),))


BIG = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=32000)


@pytest.mark.parametrize("text,loaded", [("Et|tt|ttttt|L", 2), ("Et|ttttt|tt|L", 1), ("Et|t|t|tttttL", 3)])
def test_an_uneven_layout_peaks_on_the_stage_it_loads_most(text, loaded):
    """The estimated memory's peak stage is the one the layout gives the most layers (here enough more
    to outweigh the first stages' extra micro-batches in flight); the even split peaks on stage 0."""
    lay = Layout(pp=4, pipeline_layout=text, recompute="selective")
    stages = stage_memory(BIG, lay, 8)
    assert max(range(4), key=lambda i: sum(stages[i])) == loaded
    even = stage_memory(BIG, Layout(pp=4, recompute="selective"), 8)
    assert max(range(4), key=lambda i: sum(even[i])) == 0
    est = estimate(BIG, ClusterSpec(gpus=4), 8, lay)
    assert (est.model_state_gb + est.activation_gb) * 2**30 == pytest.approx(sum(stages[loaded]))


def test_the_busiest_stage_paces_the_step():
    """Each rank's FLOPs sum to the step's; the step is paced by the busiest rank: a layout loading
    one stage more is slower, and with a big vocabulary, counting the loss as a layer (fewer layers
    beside the output layer) is faster than counting the embedding."""
    spec = dataclasses.replace(BIG, vocab_size=256000)
    cluster = ClusterSpec(gpus=4)
    for lay in (Layout(pp=4), Layout(pp=4, pipeline_layout="Et|tt|ttttt|L"), Layout(pp=2, vpp=2)):
        work = rank_work(spec, 1, rank_ranges(spec, lay), False)
        assert sum(work) * 8 == pytest.approx(num_floating_point_operations(spec.with_vocab(1), 8))
    # 32000 words: the output layer costs about two layers, so stage 2's five layers make it the busiest
    even, heavy = (estimate(BIG, cluster, 8, Layout(pp=4, pipeline_layout=t)) for t in ("Ett|tt|tt|ttL", "Et|tt|ttttt|L"))
    assert heavy.busiest > even.busiest > 1 and heavy.step_s > even.step_s
    assert heavy.bubble == even.bubble == pytest.approx(3 / 8)  # the schedule's bubble; the imbalance is apart
    assert heavy.compute_s / heavy.busiest == pytest.approx(even.compute_s / even.busiest)
    assert estimate(spec, cluster, 8, Layout(pp=1, dp=4)).busiest == 1
    odd, two = dataclasses.replace(spec, num_layers=7), ClusterSpec(gpus=2)  # 4 + 3 layers, or 3 + 4
    loss, embedding = (estimate(odd, two, 8, Layout(pp=2, **{k: True})) for k in ("account_loss", "account_embedding"))
    assert loss.busiest < embedding.busiest and loss.step_s < embedding.step_s


def test_search_proposes_the_account_flags_where_pp_does_not_divide_the_layers():
    spec = dataclasses.replace(BIG, num_layers=7)
    cluster = ClusterSpec(gpus=4)
    rows = plan(spec, cluster, 8, {"pp": 4, "tp": 1, "zero": "no_shard", "recompute": "none", "micro_batch": 1,
                                   "schedule": "1f1b"})
    splits = {(e.layout.vpp, e.split) for e in rows}
    # VPP 1: the planner's 2, 2, 2, 1 (= the loss accounted: not repeated) and the embedding accounted;
    # VPP 2: only the account flags split 7 layers over 8 virtual stages
    assert splits == {(1, "first 2 last 1"), (1, "acct E"), (2, "acct L"), (2, "acct E")}
    even = plan(BIG, cluster, 8, {"pp": 4, "tp": 1, "zero": "no_shard", "recompute": "none", "micro_batch": 1})
    assert {e.split for e in even} == {""}


def _tool(capsys, *flags):
    argv = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--vocab-size", "1000", "--gpus", "4", "--global-batch-size", "8", *flags]
    code = plan_tool.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flags,label", [
    (["--pipeline-model-parallel-layout", "E|ttt|tt|tL"], "E|ttt|tt|tL"),
    (["--pipeline-model-parallel-layout", "Et|tt|t|ttL", "--pipeline-model-parallel-size", "2"], "Et|tt|t|ttL"),
    (["--pipeline-model-parallel-size", "4", "--account-for-embedding-in-pipeline-split",
      "--account-for-loss-in-pipeline-split"], "acct E+L"),
    (["--pipeline-model-parallel-size", "4", "--account-for-loss-in-pipeline-split",
      "--virtual-pipeline-model-parallel-size", "1"], None),  # 7 slots over 4: refused below
    (["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1",
      "--pipeline-model-parallel-size", "4"], "first 1 last 1"),
])
def test_tool_takes_the_split_flags(capsys, flags, label):
    code, out, err = _tool(capsys, *flags)
    if label is None:
        assert code == 2 and err.count("\n") == 1 and "--account-for-loss-in-pipeline-split" in err
        return
    assert code == 0, err
    assert f"split {label}," in out


@pytest.mark.parametrize("flags", [
    ["--pipeline-model-parallel-layout", "Et|tt|tL"],  # 4 layers, the model has 6
    ["--pipeline-model-parallel-layout", "Et|t(t|)tL"],  # a group must repeat
    ["--pipeline-model-parallel-layout", "tE|ttt|ttL"],  # E not first
    ["--pipeline-model-parallel-layout", "Ett|tt|ttL", "--pipeline-model-parallel-size", "2"],  # 3 stages over PP 2
    ["--pipeline-model-parallel-layout", "Ett|tt|ttL", "--account-for-loss-in-pipeline-split"],
    ["--account-for-embedding-in-pipeline-split", "--decoder-first-pipeline-num-layers", "2"],
    ["--account-for-loss-in-pipeline-split", "--decoder-first-pipeline-num-layers", "0"],  # 0 is a value
])
def test_tool_refuses_a_bad_split_in_trainings_words(capsys, flags):
    """One line, exit 2, the message pipeline_ranges gives training for the same flags."""
    code, out, err = _tool(capsys, *flags)
    assert code == 2 and out == "" and err.count("\n") == 1
    args = plan_tool.build_parser().parse_args(["--num-layers", "6", "--gpus", "1", "--global-batch-size", "1", *flags])
    pp = args.pipeline_model_parallel_size or (len(args.pipeline_model_parallel_layout.split("|"))
                                               if args.pipeline_model_parallel_layout else 2)
    with pytest.raises(ValueError) as training:
        pipeline_ranges({"num_layers": 6, "pipeline_model_parallel_size": pp, "mtp_num_layers": 0,
                         "pipeline_model_parallel_layout": args.pipeline_model_parallel_layout,
                         "decoder_first_pipeline_num_layers": args.decoder_first_pipeline_num_layers,
                         "account_for_embedding_in_pipeline_split": args.account_for_embedding_in_pipeline_split,
                         "account_for_loss_in_pipeline_split": args.account_for_loss_in_pipeline_split})
    assert err == f"error: {training.value}\n"


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--tensor-model-parallel-size", "1"]


def test_tool_takes_upcycling_and_plans_the_moe_model_unchanged(capsys):
    """Upcycling only sets the experts' first values (the router keeps E rows): the plan is the MoE model's."""
    code, plain, err = _tool(capsys, *MOE)
    assert code == 0, err
    for flags in (["--moe-use-upcycling"], ["--moe-use-upcycling", "--moe-upcycling-granularity", "2"]):
        code, out, err = _tool(capsys, *MOE, *flags)
        assert code == 0 and out == plain, err


@pytest.mark.parametrize("flags,words", [
    (["--moe-use-upcycling"], "needs --num-experts"),
    ([*MOE, "--moe-upcycling-granularity", "2"], "has no effect without --moe-use-upcycling"),
    ([*MOE, "--moe-use-upcycling", "--moe-upcycling-granularity", "3"], "must divide --num-experts 4"),
    ([*MOE, "--moe-use-upcycling", "--moe-shared-expert-intermediate-size", "64"], "does not support"),
])
def test_tool_refuses_upcycling_as_training_does(capsys, flags, words):
    code, out, err = _tool(capsys, *flags)
    assert code == 2 and out == "" and err.count("\n") == 1 and words in err


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (2, 2, 2)])
def test_interleaved_chunks_of_unequal_size_hold_the_layers_their_order_keeps(p, m, v):
    """Equal chunks: the layers held are the chunk size x the whole-stage in-flight count (the formula
    every other layout uses); unequal ones (a layout's, or the account flags' first and last chunks):
    the order's own peak, so the chunk run first (held longest) weighs more."""
    for i in range(p):
        assert held_layers(p, i, m, (3,) * v) == pytest.approx(3 * v * in_flight_microbatches(p, i, m, v))
    assert held_layers(p, 0, m, (3,) + (1,) * (v - 1)) >= held_layers(p, 0, m, (1,) * (v - 1) + (3,))
    assert held_layers(2, 0, 4, (3, 1)) > held_layers(2, 0, 4, (1, 3))  # with steady-state micro-batches
    lay = Layout(pp=2, vpp=2, pipeline_layout="Ettt|ttt|t|tL", recompute="selective")  # rank 0: 3 + 1
    per_layer = layer_bytes(BIG, lay, "selective")
    acts = [a for _, a in stage_memory(BIG, lay, 4)]
    assert acts[0] == pytest.approx(held_layers(2, 0, 4, (3, 1)) * per_layer)
    assert acts[0] != pytest.approx(4 * per_layer * in_flight_microbatches(2, 0, 4, 2))
