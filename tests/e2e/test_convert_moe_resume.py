"""A mixture-of-experts checkpoint trained at EP2 x TP2 (sequence parallel, distributed optimizer),
converted with tools/checkpoint/convert.py to EP4 x TP1 after 3 of 6 iterations, resumes there and trains on as the
uninterrupted single-process run does: the expert weights, their Adam moments and fp32 masters, the
router's expert bias and the schedule all move with the experts. Grouped-GEMM experts, shared
experts, a sigmoid router with expert bias, every other layer dense. RNG states are per rank and not
carried (``--no-load-rng``; dropout is 0). Every step's loss and gradient norm, before and after the
conversion, agrees with the single-process run's within rel 1e-5.
"""

import os

import torch

from megatron_lite.checkpoint.merge import merge_checkpoint
from tests.e2e.test_convert_resume import _same_optimizer
from tests.e2e.test_pretrain_gpt import _argv
from tests.e2e.test_pretrain_moe import MOE, MOE_B
from tests.tools import load_tool
from tests.trajectory import assert_same_trajectory, ranks_trajectory, run_script

_CAPACITY = MOE_B.index("--moe-expert-capacity-factor")
# without capacity dropping: under TP2 x SP each rank routes (and drops within) its own sequence shard
FLAGS = MOE + MOE_B[:_CAPACITY] + MOE_B[_CAPACITY + 2:]


def test_ep2_tp2_checkpoint_resumes_at_ep4_like_the_single_process_run(tmp_path):
    src, ep4, back = (str(tmp_path / n) for n in ("ep2tp2", "ep4", "back"))
    layout = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--use-distributed-optimizer"]
    first = ranks_trajectory(4, "pretrain_gpt", _argv(src, 6, FLAGS + layout + ["--exit-interval", "3"]))
    convert = load_tool("checkpoint/convert").main
    assert convert(["--model-type", "GPT", "--load-dir", src, "--save-dir", ep4, "--target-tensor-parallel-size", "1",
                    "--target-expert-parallel-size", "4"]) == 0

    resumed = ranks_trajectory(4, "pretrain_gpt", _argv(str(tmp_path / "a"), 6, FLAGS + [
        "--expert-model-parallel-size", "4", "--load", ep4, "--no-load-rng"]))
    straight = run_script("pretrain_gpt", _argv(str(tmp_path / "b"), 6, FLAGS))
    assert_same_trajectory(first + resumed, straight, steps=6)  # 3 steps at EP2 x TP2, 3 after the conversion

    # back to EP2 x TP2: the optimizer state (moments, masters, groups, scaler) equals training's own
    assert convert(["--model-type", "GPT", "--load-dir", ep4, "--save-dir", back, "--target-tensor-parallel-size", "2",
                    "--target-expert-parallel-size", "2"]) == 0
    for t in range(2):
        for e in range(2):
            rank_dir = f"mp_rank_{t:02d}_000_{e:03d}"
            want, got = (torch.load(os.path.join(root, "iter_0000003", rank_dir, "model_optim_rng.pt"), weights_only=True)
                         for root in (src, back))
            assert got["scheduler"] == want["scheduler"]
            _same_optimizer(got["optimizer"], want["optimizer"], rows=123 - 64 * t)


def test_folded_torch_dist_checkpoint_converts_to_one_process(tmp_path):
    """Parallel folding: a torch_dist checkpoint of attention DP 2 with every expert split over ETP 2 (TP 1)
    converts to one process (--target-expert-tensor-parallel-size 1: the default keeps the source's
    ETP 2, a folded grid) and resumes there like the uninterrupted run; the converted config records
    ETP 1 (whole experts: unfolded files)."""
    src, one = str(tmp_path / "etp2"), str(tmp_path / "one")
    folded = ["--expert-tensor-parallel-size", "2", "--ckpt-format", "torch_dist"]
    first = ranks_trajectory(2, "pretrain_gpt", _argv(src, 6, MOE + folded + ["--exit-interval", "3"]))
    assert load_tool("checkpoint/convert").main(["--model-type", "GPT", "--load-dir", src, "--save-dir", one,
                                                 "--target-expert-tensor-parallel-size", "1"]) == 0
    assert merge_checkpoint(one)[1].get("expert_tensor_parallel_size") == 1
    resumed = run_script("pretrain_gpt", _argv(str(tmp_path / "a"), 6, MOE + ["--load", one, "--no-load-rng"]))
    straight = run_script("pretrain_gpt", _argv(str(tmp_path / "b"), 6, MOE))
    assert_same_trajectory(first + resumed, straight, steps=6)
