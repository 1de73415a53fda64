"""pretrain_gpt.py --moe-use-upcycling: an MoE run started from a dense checkpoint.

Two dense models are trained 3 steps and saved: A (SwiGLU, no biases) at TP2 + SP on 2 ranks, in the
``torch`` format; B (GeLU with biases) in one process, in ``torch_dist``. Each is then read by
``--finetune --load`` (iteration 0, the first batch again) for the dense model's loss on that batch,
and upcycled in one process: the upcycled model's first loss is the dense model's, within fp32 1e-6:

* A at granularity 1: 4 experts, top-2, each a copy of the dense MLP;
* B at granularity 2: 8 experts (two copies of the dense MLP, each cut into 2 halves of its FFN),
  top-4, grouped GEMM, every other layer dense (``--moe-layer-freq``), and a
  ``--moe-router-topk-scaling-factor`` of 2.5, which the experts' scale divides out.

A's upcycled run then trains 6 steps (saving at 3): EP2 with ZeRO-3 from the same dense checkpoint gives
the same losses and gradient norms (relative 1e-5); a resume from its step-3 checkpoint with the flag still given
loads the MoE checkpoint as is and continues bit for bit; and the trained MoE model's loss on the first
batch is below the upcycled model's.
"""

import os
import shutil

import pytest

from megatron_lite.checkpoint.format import TRACKER_FILENAME
from tests.e2e.test_pretrain_gpt import MODEL, _one_line_exit_2
from tests.trajectory import assert_same_trajectory, ranks_trajectory, run_script

BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8"]
DENSE_A = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
           "--ffn-hidden-size", "128"]
DENSE_B = ["--ffn-hidden-size", "128"]  # GeLU, biases on, learned positions, LayerNorm
MOE_A = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall"]
MOE_B = ["--num-experts", "8", "--moe-router-topk", "4", "--moe-upcycling-granularity", "2",
         "--moe-ffn-hidden-size", "64", "--moe-grouped-gemm", "--moe-layer-freq", "([1,0]*2)",
         "--moe-router-topk-scaling-factor", "2.5"]
FIRST_LOSS_RTOL = 1e-6


def _argv(extra, iters):
    return MODEL + BATCH + ["--train-iters", str(iters)] + list(extra)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """{variant: (dense checkpoint folder, the dense model's loss on the first batch)}."""
    tmp = tmp_path_factory.mktemp("upcycling")
    out = {}
    for variant, model, world, layout in (("A", DENSE_A, 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                                          ("B", DENSE_B, 1, ["--ckpt-format", "torch_dist"])):
        save = str(tmp / f"dense{variant}")
        argv = _argv(model + layout + ["--save", save], 3)
        ranks_trajectory(world, "pretrain_gpt", argv) if world > 1 else run_script("pretrain_gpt", argv)
        reference = run_script("pretrain_gpt", _argv(model + ["--load", save, "--finetune"], 3))
        out[variant] = (save, reference.losses[0])
    return out


def _upcycle_argv(dense_folder, model, moe, save, iters, extra=()):
    return _argv(model + moe + ["--moe-use-upcycling", "--load", dense_folder, "--save", save] + list(extra), iters)


def test_granular_upcycling_keeps_the_dense_loss(dense, tmp_path):
    folder, dense_loss = dense["B"]
    up = run_script("pretrain_gpt", _upcycle_argv(folder, DENSE_B, MOE_B, str(tmp_path / "up"), 3))
    assert up.losses[0] == pytest.approx(dense_loss, rel=FIRST_LOSS_RTOL, abs=0)


def test_upcycled_run_trains_resumes_and_matches_ep2(dense, tmp_path):
    folder, dense_loss = dense["A"]
    up_dir = str(tmp_path / "up")
    whole = run_script("pretrain_gpt", _upcycle_argv(folder, DENSE_A, MOE_A, up_dir, 6, ["--save-interval", "3"]))
    assert whole.losses[0] == pytest.approx(dense_loss, rel=FIRST_LOSS_RTOL, abs=0)

    # EP2 (the alltoall dispatcher across ranks) with ZeRO-3 (the routers kept while the loaded weights are
    # sharded) from the same TP2 dense checkpoint
    ep2 = ranks_trajectory(2, "pretrain_gpt", _upcycle_argv(folder, DENSE_A, MOE_A, str(tmp_path / "ep2"), 6,
                                                            ["--save-interval", "3", "--expert-model-parallel-size", "2",
                                                             "--data-parallel-sharding-strategy", "optim_grads_params"]))
    assert_same_trajectory(ep2, whole, what="upcycled EP2 vs one process")

    # resume at step 3 with the flag still given: the checkpoint has experts, so it is loaded as is
    resumed_dir = str(tmp_path / "resumed")
    shutil.copytree(up_dir, resumed_dir)
    shutil.rmtree(os.path.join(resumed_dir, "iter_0000006"))
    with open(os.path.join(resumed_dir, TRACKER_FILENAME), "w") as f:
        f.write("3")
    resumed = run_script("pretrain_gpt", _upcycle_argv(resumed_dir, DENSE_A, MOE_A, resumed_dir, 6))
    assert resumed == whole[3:]

    # trained: the MoE model's loss on the first batch is below the upcycled (dense) model's
    trained = run_script("pretrain_gpt", _argv(DENSE_A + MOE_A + ["--load", up_dir, "--finetune"], 3))
    assert trained.losses[0] < whole.losses[0]


@pytest.mark.parametrize("extra, words", [
    # the experts' width must be the dense MLP's / G
    (["--moe-ffn-hidden-size", "64"], ["128 wide", "--moe-ffn-hidden-size 128"]),
    # the dense layers keep the checkpoint's MLP
    (["--moe-layer-freq", "([1,0]*2)", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "128"],
     ["--ffn-hidden-size 64", "--ffn-hidden-size 128"]),
    # another model
    (["--num-query-groups", "2", "--group-query-attention"], ["num-query-groups 4 (this run 2)"]),
])
def test_dense_checkpoint_that_does_not_fit_is_refused(dense, tmp_path, capsys, extra, words):
    folder, _ = dense["A"]
    argv = _upcycle_argv(folder, DENSE_A, MOE_A, str(tmp_path / "up"), 3, extra)
    _one_line_exit_2(capsys, argv, "--moe-use-upcycling" if "wide" in words[0] else "", *words)
    save = tmp_path / "up"
    assert not save.exists() or not any(save.iterdir())  # nothing saved (start-up may make the folder)


def test_save_holding_a_checkpoint_is_refused(dense, capsys):
    folder, _ = dense["A"]
    _one_line_exit_2(capsys, _upcycle_argv(folder, DENSE_A, MOE_A, folder, 3), f"--save {folder} already holds")


def test_dense_checkpoint_without_the_flag_points_at_it(dense, tmp_path, capsys):
    """An MoE run given a dense --load without --moe-use-upcycling is refused as before, naming the flag."""
    folder, _ = dense["A"]
    argv = _argv(DENSE_A + MOE_A + ["--load", folder, "--finetune"], 3)
    _one_line_exit_2(capsys, argv, "no --num-experts (this run: --num-experts 4)", "pass --moe-use-upcycling")
