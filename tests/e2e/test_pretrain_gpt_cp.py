"""pretrain_gpt.py with context parallelism reproduces the single-process run.

Same pattern as test_pretrain_gpt.py: every parallel run calls ``pretrain_gpt.main(argv)`` on each
rank of a gloo pool; the reference is the same command in this process. Same seed, same global
batch, dropout 0, fp32: every step's loss and gradient norm within a relative 1e-5 of the
single-process run's (the gradient norm catches a gradient-averaging factor at step 1), and
the final weights (merged from the checkpoints) within rtol 1e-5. Covered: p2p (ring), a2a,
allgather and a2a+p2p (CP4 as 2 x 2); learned positions (variant A) and RoPE + GQA (variant B); EOD-masked losses and reset
positions; recomputation; CP composed with TP+SP, DP (+ distributed optimizer) and PP; exact resume;
a CP2 checkpoint resumed at CP1; the one-line flag errors.
"""

import pytest

import pretrain_gpt
from tests.e2e.test_pretrain_gpt import (
    MODEL,
    MODEL_B,
    _argv,
    _one_line_exit_2,
    _parallel,
    _same_weights,
    _single,
)
from tests.harness import run_ranks
from tests.trajectory import assert_same_trajectory, ranks_trajectory, run_script

ITERS = 5  # past the 2 warm-up steps (test_pretrain_gpt: both references' 5th loss is below their first)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cpref")
    return {variant: _single(tmp, f"single{variant}", ITERS, extra) for variant, extra in (("A", []), ("B", MODEL_B))}


CP2 = ["--context-parallel-size", "2"]


@pytest.mark.parametrize(
    "name, world, variant, extra",
    [
        ("cp2", 2, "A", CP2),
        ("cp2_rope_gqa", 2, "B", CP2),
        ("cp4", 4, "B", ["--context-parallel-size", "4"]),
        ("cp2_a2a", 2, "A", CP2 + ["--cp-comm-type", "a2a"]),
        ("cp2_allgather", 2, "B", CP2 + ["--cp-comm-type", "allgather"]),
        ("cp2_tp2_sp", 4, "B", CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("cp2_tp2_sp_a2a", 4, "A", CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                          "--cp-comm-type", "a2a"]),
        ("cp2_dp2_distopt", 4, "B", CP2 + ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
        ("cp2_dp2_zero3", 4, "A", CP2 + ["--data-parallel-sharding-strategy", "optim_grads_params"]),
        ("cp2_pp2", 4, "A", CP2 + ["--pipeline-model-parallel-size", "2"]),
        ("cp2_tp2_pp2_sp", 8, "B", CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                          "--pipeline-model-parallel-size", "2"]),
        ("cp2_per_layer_types", 2, "A", CP2 + ["--cp-comm-type", "p2p", "a2a", "allgather", "p2p"]),
        ("cp4_a2a_p2p_2x2", 4, "B", ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                     "--hierarchical-context-parallel-sizes", "2", "2"]),
    ],
)
def test_context_parallel_runs_reproduce_single_process(tmp_path, reference, name, world, variant, extra):
    ref, ref_save = reference[variant]
    got, save = _parallel(tmp_path, name, world, ITERS, (MODEL_B if variant == "B" else []) + extra)
    assert_same_trajectory(got, ref, steps=ITERS)
    _same_weights(save, ref_save)


def test_cp2_checkpoint_resumes_at_cp1(tmp_path, reference):
    """Checkpoints do not depend on the CP size: half a run at CP2, the rest in one process."""
    ref, _ = reference["B"]
    save = str(tmp_path / "cp2")
    first = ranks_trajectory(2, "pretrain_gpt", _argv(save, ITERS, MODEL_B + CP2 + ["--exit-interval", str(ITERS // 2)]))
    second = run_script("pretrain_gpt", _argv(save, ITERS, MODEL_B + ["--load", save]))
    assert_same_trajectory(first + second, ref, steps=ITERS)


def test_cp1_checkpoint_resumes_at_cp2(tmp_path, reference):
    ref, _ = reference["A"]
    save = str(tmp_path / "cp1")
    first = run_script("pretrain_gpt", _argv(save, ITERS, ["--exit-interval", str(ITERS // 2)]))
    # the checkpoint holds one RNG state per saving rank: more ranks than that need --no-load-rng
    second = ranks_trajectory(2, "pretrain_gpt", _argv(save, ITERS, CP2 + ["--load", save, "--no-load-rng"]))
    assert_same_trajectory(first + second, ref, steps=ITERS)


def test_cp2_resume_continues_exactly(tmp_path):
    extra = MODEL_B + CP2 + ["--use-distributed-optimizer"]
    straight, _ = _parallel(tmp_path, "straight", 2, 6, extra)
    save = str(tmp_path / "resumed")
    first = ranks_trajectory(2, "pretrain_gpt", _argv(save, 6, extra + ["--exit-interval", "3"]))
    second = ranks_trajectory(2, "pretrain_gpt", _argv(save, 6, extra + ["--load", save]))
    assert_same_trajectory(first + second, straight, rtol=0)  # bit-identical


@pytest.mark.parametrize(
    "flags, world, words",
    [
        (["--context-parallel-size", "2", "--seq-length", "18"], 2, ["seq-length 18", "divisible by 2 x cp"]),
        (["--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel",
          "--seq-length", "20"], 8, ["--sequence-parallel", "seq-length 20 / cp = 10", "tensor-model-parallel-size 4"]),
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "6", "--hidden-size", "36"],
         4, ["--cp-comm-type a2a", "num-attention-heads 6", "context-parallel-size 4"]),
        (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention", "--num-query-groups", "1"],
         2, ["--cp-comm-type a2a", "num-query-groups 1"]),
        (["--cp-comm-type", "p2p", "a2a"], 1, ["--cp-comm-type takes one value or one per layer"]),
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"], 4,
         ["--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B", "--context-parallel-size 4"]),
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "3"],
         4, ["--hierarchical-context-parallel-sizes 2 3", "A x B = --context-parallel-size 4"]),
        (["--context-parallel-size", "4", "--cp-comm-type", "p2p", "a2a", "allgather", "p2p",
          "--hierarchical-context-parallel-sizes", "2", "2"], 4,
         ["--hierarchical-context-parallel-sizes only applies with --cp-comm-type a2a+p2p"]),
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2",
          "--group-query-attention", "--num-query-groups", "1"], 4,
         ["--cp-comm-type a2a+p2p needs --num-query-groups 1", "all-to-all size 2"]),
    ],
)
def test_bad_context_parallel_flags_exit_2_with_one_line(capsys, monkeypatch, flags, world, words):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    _one_line_exit_2(capsys, MODEL + ["--micro-batch-size", "2"] + flags, *words)


def test_cp2_tp2_sp_needs_only_the_rank_tokens_divisible_by_tp(tmp_path):
    """Sequence parallelism cuts a CP rank's seq / cp tokens over TP: seq 12 at CP2 x TP2 (6 tokens
    a rank, 3 per TP rank) runs like one process (Megatron-LM asks seq % 2cp only); it was refused
    as 'not divisible by 2 x cp x tp = 8'."""
    seq = ["--seq-length", "12"]
    ref = run_script("pretrain_gpt", _argv(str(tmp_path / "single"), 4, MODEL_B + seq))
    extra = MODEL_B + seq + CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    got = ranks_trajectory(4, "pretrain_gpt", _argv(str(tmp_path / "cp2tp2"), 4, extra))
    assert_same_trajectory(got, ref)


def test_cp2_recompute_gives_the_same_losses(tmp_path, reference):
    """Selective (core attention) and full recomputation re-run the ring in backward: same
    trajectory without dropout; with dropout on, recomputation replays the ring's masks exactly."""
    ref, _ = reference["A"]
    selective = ["--recompute-granularity", "selective"]
    got, _ = _parallel(tmp_path, "sel", 2, ITERS, CP2 + selective)
    assert_same_trajectory(got, ref, steps=ITERS)
    drop = CP2 + ["--attention-dropout", "0.2", "--hidden-dropout", "0.1"]
    base, _ = _parallel(tmp_path, "drop", 2, 4, drop)
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    for extra in (selective, full):
        again, _ = _parallel(tmp_path, extra[1], 2, 4, drop + extra)
        assert_same_trajectory(again, base, steps=4, what=extra[1])
    assert base.losses[0] != pytest.approx(got.losses[0], rel=1e-6)  # the dropout run really differs


def test_cp2_with_eod_loss_mask_and_reset_positions_and_attention(tmp_path):
    """Mock samples carry one EOD at a random position: with --eod-mask-loss the CP ranks hold
    different numbers of counted tokens (the loss must still be the global token mean),
    --reset-position-ids gives positions that restart mid-sequence (split with the tokens), and
    --reset-attention-mask confines attention to each document (its ids split with the tokens and
    carried around the ring / gathered by a2a and allgather)."""
    extra = ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]
    reference = run_script("pretrain_gpt", _argv(str(tmp_path / "single"), 6, extra))
    for name, flags in (("p2p", []), ("a2a", ["--cp-comm-type", "a2a"]), ("allgather", ["--cp-comm-type", "allgather"])):
        got = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / name), 6, extra + CP2 + flags))
        assert_same_trajectory(got, reference, what=name)
        _same_weights(str(tmp_path / name), str(tmp_path / "single"))
    plain = run_script("pretrain_gpt", _argv(str(tmp_path / "plain"), 6, extra[:2]))
    assert plain.losses != pytest.approx(reference.losses, rel=1e-6)  # the document mask matters


def run_cli_validation(argv):
    """Inside a rank: train and return this rank's (iteration, validation loss) records."""
    return pretrain_gpt.main(argv).validation


def test_cp2_validation_loss_equals_single_process(tmp_path):
    evaluation = ["--eval-interval", "2", "--eval-iters", "2"]  # overrides MODEL's --eval-iters 0
    single = pretrain_gpt.main(_argv(str(tmp_path / "single"), 4, evaluation)).validation
    ranks = run_ranks(2, run_cli_validation, _argv(str(tmp_path / "cp2"), 4, evaluation + CP2))
    records = [r for r in ranks if r]
    assert all(r == records[0] for r in records)  # both CP ranks hold the CP-wide mean
    assert len(records[0]) == len(single) == 2  # after steps 2 and 4
    for (it, value), (it_ref, ref) in zip(records[0], single):
        assert it == it_ref and abs(value - ref) <= 1e-5 * abs(ref), (it, value, ref)
