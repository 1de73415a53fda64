"""FP8 under ZeRO-3 (``--data-parallel-sharding-strategy optim_grads_params``) through pretrain_gpt.py.

ZeRO-3 gathers each layer's full weight before its forward, so the FP8 gemm takes the weight's amax
from the whole weight, and the once-per-step update MAX-reduces the amaxes over data parallelism as
with every other strategy. Proof, at DP2 (and PP2 x DP2 with full recompute):

* the ZeRO-3 run equals the same run with strategy ``optim`` step by step: losses and gradient
  norms within a relative 1e-6 (seen: losses bit-identical, norms 4e-7 apart: the norm is summed
  over other shards), for delayed and tensorwise scaling; after 6 steps (the 4-long histories rolled twice) every amax history and
  scale in the checkpoint is bit-identical to the ``optim`` run's;
* it follows the one-process FP8 run within the FP8 tests' tolerance (tests/e2e/test_fp8.py), and
  after one step holds that run's input and weight scales (to 1e-6): the weight amax is the full
  weight's, the input amax the whole global batch's;
* MoE at EP2 (grouped FP8 experts): within the FP8 expert tolerance of the ``optim`` run (seen: the
  step-1 gradient norms differ in the last bit, as ZeRO-3 sums the norm over other shards; gradient
  clipping carries that into the weights and the experts' delayed scales amplify it: losses 2e-5,
  norms 3e-4 apart by step 6; the same runs in bf16 agree to the last bit in the losses);
* resume: stopped after 4 of 8 steps and resumed, in the torch and the torch_dist format, the
  losses are bit-identical to the uninterrupted ZeRO-3 run; a ZeRO-3 FP8 checkpoint resumed with
  strategy ``optim`` continues it too (checkpoints hold full tensors whatever the strategy), and
  tools/checkpoint/convert.py converts it to TP2 with its amax histories and scales unchanged.
"""

import torch

from megatron_lite.checkpoint.merge import merge_checkpoint
from megatron_lite.precision.fp8 import is_fp8_state_key
from tests.e2e.test_fp8 import FP8, GRAD_RTOL, MOE_GRAD_RTOL
from tests.e2e.test_pretrain_gpt import _argv
from tests.tools import load_tool
from tests.trajectory import assert_same_trajectory, ranks_trajectories, run_script

ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce", "--overlap-param-gather"]
ZERO1 = ["--data-parallel-sharding-strategy", "optim"]
DELAYED = FP8 + ["--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
TENSORWISE = FP8 + ["--fp8-recipe", "tensorwise"]
ITERS = 6
SAME = 1e-6  # ZeRO-3 against strategy optim: only the gradient norm's summation order differs
# Clipping off in effect (the norm is still computed and logged): at --clip-grad 1 the two runs' norms, a few
# ulps apart from their summation order, give clip factors a few ulps apart, and FP8's rounding of the
# weights turns that into loss differences of ~1e-5 by step 5 (seen on a CPU whose FP8 GEMMs run in bf16).
NO_CLIP = ["--clip-grad", "1000"]


def _fp8_state(save) -> dict:
    state, _ = merge_checkpoint(save)
    return {k: v for k, v in state.items() if is_fp8_state_key(k)}


def test_zero3_fp8_equals_strategy_optim_and_follows_one_process(tmp_path):
    runs = {(recipe, name): (_argv(str(tmp_path / f"{recipe}_{name}"), ITERS, flags + extra + NO_CLIP))
            for recipe, flags in (("delayed", DELAYED), ("tensorwise", TENSORWISE))
            for name, extra in (("zero1", ZERO1), ("zero3", ZERO3))}
    got = dict(zip(runs, ranks_trajectories(2, "pretrain_gpt", list(runs.values())), strict=True))
    for recipe in ("delayed", "tensorwise"):
        assert_same_trajectory(got[recipe, "zero3"], got[recipe, "zero1"], rtol=SAME, steps=ITERS, what=recipe)
    zero1, zero3 = _fp8_state(str(tmp_path / "delayed_zero1")), _fp8_state(str(tmp_path / "delayed_zero3"))
    assert len(zero3) == 2 * 4 * 4 and zero3.keys() == zero1.keys()  # (history, scale) x 4 gemms x 4 layers
    for name, value in zero3.items():
        torch.testing.assert_close(value, zero1[name], rtol=0, atol=0, msg=name)
    assert all(not torch.equal(v, torch.ones(3)) for k, v in zero3.items() if k.endswith(".scale"))  # learned
    one = run_script("pretrain_gpt", _argv(str(tmp_path / "one"), ITERS, DELAYED + NO_CLIP))
    assert_same_trajectory(got["delayed", "zero3"], one, rtol=1e-3, grad_rtol=GRAD_RTOL, steps=ITERS, what="one process")


def test_zero3_fp8_after_one_step_holds_the_one_process_input_and_weight_scales(tmp_path):
    """Step 1 (same weights everywhere; each micro-batch computes as in the one-process run): the
    weight scales must be the one-process run's, which they are only if the amax is taken from the
    full gathered weight, and the input scales too, which they are only if the amaxes are reduced
    over the replicas (without that, seen: 2-5% off for half the gemms). The output-gradient scales
    are left out: a replica's gradients before the data-parallel average are dp times the one
    process's (the scales differ by that power of two, under every strategy)."""
    one_step = FP8 + ["--lr-warmup-iters", "0"]
    run_script("pretrain_gpt", _argv(str(tmp_path / "one"), 1, one_step))
    ranks_trajectories(2, "pretrain_gpt", [_argv(str(tmp_path / "zero3"), 1, one_step + ZERO3)])
    ref, got = _fp8_state(str(tmp_path / "one")), _fp8_state(str(tmp_path / "zero3"))
    scales = [k for k in ref if k.endswith(".scale")]
    assert len(scales) == 16 and got.keys() == ref.keys()
    for name in scales:
        assert not torch.equal(got[name][:2], torch.ones(2)), name  # learned from the step's amaxes
        torch.testing.assert_close(got[name][:2], ref[name][:2], rtol=1e-6, atol=0, msg=name)


def test_zero3_fp8_pipeline_and_full_recompute_equal_strategy_optim(tmp_path):
    extra = DELAYED + ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                       "--recompute-method", "uniform", "--recompute-num-layers", "1"] + NO_CLIP
    zero1, zero3 = ranks_trajectories(4, "pretrain_gpt", [_argv(str(tmp_path / name), ITERS, extra + flags)
                                                          for name, flags in (("zero1", ZERO1), ("zero3", ZERO3))])
    assert_same_trajectory(zero3, zero1, rtol=SAME, steps=ITERS, what="pp2 x dp2, full recompute")


def test_zero3_fp8_experts_follow_strategy_optim(tmp_path):
    extra = DELAYED + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm",
                       "--expert-model-parallel-size", "2"]
    zero1, zero3 = ranks_trajectories(2, "pretrain_gpt", [_argv(str(tmp_path / name), ITERS, extra + flags)
                                                          for name, flags in (("zero1", ZERO1), ("zero3", ZERO3))])
    assert_same_trajectory(zero3, zero1, rtol=1e-3, grad_rtol=MOE_GRAD_RTOL, steps=ITERS, what="ep2 experts")


def test_zero3_fp8_resume_continues_exactly(tmp_path):
    """Stop after 4 of 8 steps and resume (torch, torch_dist; and a ZeRO-3 checkpoint resumed with
    strategy optim): the amax histories and scales are saved, so the resumed steps quantise as the
    uninterrupted run does: bit-identical losses (the strategy switch: within SAME)."""
    argvs = [_argv(str(tmp_path / "straight"), ITERS, DELAYED + ZERO3)]
    for fmt in ("torch", "torch_dist"):
        save = str(tmp_path / fmt)
        first = DELAYED + ZERO3 + ["--ckpt-format", fmt]
        argvs += [_argv(save, ITERS, first + ["--exit-interval", "4"]), _argv(save, ITERS, first + ["--load", save])]
    save = str(tmp_path / "switch")
    argvs += [_argv(save, ITERS, DELAYED + ZERO3 + ["--exit-interval", "4"]),
              _argv(save, ITERS, DELAYED + ZERO1 + ["--load", save])]
    straight, *halves = ranks_trajectories(2, "pretrain_gpt", argvs)
    for (first, second), rtol, what in zip(zip(halves[::2], halves[1::2]), (0, 0, SAME), ("torch", "torch_dist", "switch")):
        assert len(first) == 4
        assert_same_trajectory(first + second, straight, rtol=rtol, steps=ITERS, what=what)
    tp2 = str(tmp_path / "tp2")  # the converter reads a ZeRO-3 FP8 checkpoint as any other and keeps its scales
    assert load_tool("checkpoint/convert").main(["--model-type", "GPT", "--load-dir", str(tmp_path / "torch"),
                                                 "--save-dir", tp2, "--target-tensor-parallel-size", "2"]) == 0
    want, got = _fp8_state(str(tmp_path / "torch")), _fp8_state(tp2)
    assert len(want) == 2 * 4 * 4 and got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())
