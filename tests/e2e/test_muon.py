"""--optimizer muon through pretrain_gpt.py (GQA, SwiGLU: the fused QKV and fc1 weights split over TP).

* Stopped at step 2 and resumed from the torch checkpoint, with --bf16 (fp32 masters), clipping and the
  learning-rate schedule, steps 3-4 are the uninterrupted run's bit for bit (Muon's momentum and
  AdamW's moments resumed).
* At TP2 + SP with ``--muon-tp-mode duplicated`` the steps equal one process (rel 1e-5), and its
  torch_dist checkpoint resumes in one process (the state resharded) on the one-process trajectory;
  so do a model's grouped experts split over TP (each expert's stacked matrices gathered).
  tools/checkpoint/convert.py turns that checkpoint into a TP1 torch one (Muon's matrices hold only a
  momentum buffer, the rest only Adam's moments and step) that resumes on the same trajectory.
* Refusals: one line, exit 2 (the sharded optimizers, dist_muon, bad values, another optimizer's state).
"""

import pytest

import pretrain_gpt
from tests.cli_errors import parse_refused, refused_line
from tests.tools import load_tool
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectories

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--swiglu", "--seq-length", "16", "--vocab-size", "123",
         "--make-vocab-size-divisible-by", "8", "--mock-data", "--lr", "1e-2", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--eval-iters", "0", "--log-interval", "1", "--train-iters", "4",
         "--lr-decay-iters", "4", "--clip-grad", "0.5", "--optimizer", "muon", "--muon-use-nesterov",
         "--muon-fp32-matmul-prec", "high", "--attention-dropout", "0", "--hidden-dropout", "0"]
DUPLICATED = ["--muon-tp-mode", "duplicated"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
MOE = ["--num-experts", "4", "--moe-grouped-gemm", "--moe-router-topk", "2"]  # experts split over TP (ETP 2)


def test_resume_is_exact_and_tp2_equals_one_process(tmp_path):
    full = pretrain_gpt.main(MODEL + ["--bf16"])
    part = str(tmp_path / "part")
    first = pretrain_gpt.main(MODEL + ["--bf16", "--save", part, "--exit-interval", "2"])
    second = pretrain_gpt.main(MODEL + ["--bf16", "--save", part, "--load", part])
    assert Trajectory.of(first) + Trajectory.of(second) == Trajectory.of(full)

    single = Trajectory.of(pretrain_gpt.main(MODEL + DUPLICATED))
    moe_single = Trajectory.of(pretrain_gpt.main(MODEL + DUPLICATED + MOE))
    tp2_dir = str(tmp_path / "tp2")
    tp2, moe_tp2 = ranks_trajectories(2, "pretrain_gpt", [MODEL + DUPLICATED + TP2 + [
        "--ckpt-format", "torch_dist", "--save", tp2_dir, "--exit-interval", "2"], MODEL + DUPLICATED + MOE + TP2])
    assert_same_trajectory(moe_tp2, moe_single, rtol=1e-5)
    resumed = Trajectory.of(pretrain_gpt.main(MODEL + DUPLICATED + ["--load", tp2_dir, "--ckpt-format", "torch_dist",
                                                                          "--no-load-rng"]))
    assert_same_trajectory(tp2 + resumed, single, rtol=1e-5)
    converted_dir = str(tmp_path / "tp1")  # the converter reshards it into the torch format (Muon's partial state)
    assert load_tool("checkpoint/convert").main([
        "--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", tp2_dir,
        "--save-dir", converted_dir, "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"]) == 0
    converted = Trajectory.of(pretrain_gpt.main(MODEL + DUPLICATED + ["--load", converted_dir, "--no-load-rng"]))
    assert_same_trajectory(converted, single[2:], rtol=1e-5)


@pytest.mark.parametrize("flags, words", [
    (["--use-distributed-optimizer"], ["--optimizer muon with a sharded optimizer", "drop both flags"]),
    (["--data-parallel-sharding-strategy", "optim_grads"], ["strategy optim_grads): Muon needs whole matrices"]),
    (["--muon-momentum", "1"], ["--muon-momentum must be in [0, 1)"]),
    (["--muon-num-ns-steps", "0"], ["--muon-num-ns-steps must be at least 1"]),
    (["--muon-extra-scale-factor", "-0.2"], ["--muon-extra-scale-factor must not be negative", "uphill"]),
])
def test_refusals(capsys, flags, words):
    parse_refused(capsys, MODEL + flags, *words, world_size=2)


def test_dist_muon_is_refused_naming_muon(capsys):
    parse_refused(capsys, MODEL + ["--optimizer", "dist_muon"], "layer-wise distributed Muon", "use --optimizer muon")


def test_resume_of_adam_state_is_refused(tmp_path, capsys):
    save = str(tmp_path / "adam")
    pretrain_gpt.main(MODEL[:-9] + MODEL[-4:] + ["--save", save, "--train-iters", "1"])
    capsys.readouterr()
    refused_line(capsys, lambda: pretrain_gpt.main(MODEL + ["--load", save]),
                 "holds adam state, this run uses --optimizer muon", "--no-load-optim")
