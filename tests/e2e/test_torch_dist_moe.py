"""--ckpt-format torch_dist with expert parallelism: experts are saved under their global numbers
(stacked grouped-GEMM weights along the global expert axis), each by expert-data-parallel rank 0 of
its expert-parallel rank, and the distributed optimizer's expert slices by every expert-DP rank. A
checkpoint saved at EP2 resumes at EP1, EP4 and TP2 with the losses of an uninterrupted
single-process run (relative 1e-5), optimizer state included; FP8 experts resume too. One saved with
two distributed-optimizer instances (hybrid sharding) resumes with one, at EP2 and at EP1."""

import pytest

from tests.e2e.test_fp8 import MOE_GRAD_RTOL
from tests.e2e.test_pretrain_gpt import _argv, _same_weights
from tests.e2e.test_pretrain_moe import MOE
from tests.trajectory import assert_same_trajectory, ranks_trajectory, run_script

DIST = ["--ckpt-format", "torch_dist"]
ITERS, STOP = 5, 2
FP8_ITERS = 6  # stopped at 2: 4 steps after loading at EP1
EP = "--expert-model-parallel-size"


@pytest.mark.parametrize("model, save_world, save_flags, resumes", [
    # sequential experts; the distributed optimizer shards expert state over expert-DP 2, dense over DP 4
    (MOE, 4, [EP, "2", "--use-distributed-optimizer"],
     [(2, [EP, "1", "--use-distributed-optimizer"]), (4, [EP, "4", "--use-distributed-optimizer"])]),
    # grouped experts (stacked weights [E_local, ...]); plain optimizer
    (MOE + ["--moe-grouped-gemm"], 2, [EP, "2"],
     [(4, [EP, "4"]), (2, [EP, "1", "--tensor-model-parallel-size", "2", "--sequence-parallel"])]),
    # hybrid sharding: expert state over one expert-DP rank per instance, two instances; resumed without
    # it at the same layout and at EP1 x DP2
    (MOE, 4, [EP, "2", "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
     [(4, [EP, "2", "--use-distributed-optimizer"]), (2, [EP, "1", "--use-distributed-optimizer"])]),
], ids=["sequential_ep2dp2_distopt", "grouped_ep2", "hybrid_ep2dp4x2"])
def test_ep2_torch_dist_checkpoint_resumes_at_ep1_ep4_and_tp2(tmp_path, model, save_world, save_flags, resumes):
    src = str(tmp_path / "src")
    whole = run_script("pretrain_gpt", _argv(str(tmp_path / "whole"), ITERS, model))
    first = ranks_trajectory(save_world, "pretrain_gpt", _argv(src, ITERS, model + DIST + save_flags + [
        "--exit-interval", str(STOP)]))
    for i, (world, flags) in enumerate(resumes):
        again = ranks_trajectory(world, "pretrain_gpt", _argv(str(tmp_path / f"r{i}"), ITERS, model + DIST + flags + [
            "--load", src, "--no-load-rng"]))
        assert_same_trajectory(first + again, whole, steps=ITERS, what=" ".join(flags))


def test_ep2_fp8_grouped_torch_dist_resumes_exactly_and_at_ep1(tmp_path):
    """FP8 experts' amax histories and scales are saved per global expert: resuming at EP2 continues
    bit for bit, and the checkpoint loads at EP1 (DP2), where the 4 steps after it follow the
    single-process FP8 run (FP8 tolerance: losses relative 1e-3, gradient norms test_fp8.MOE_GRAD_RTOL)."""
    extra = ["--bf16", "--fp8-format", "hybrid"] + MOE + ["--moe-grouped-gemm"] + DIST
    straight = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "straight"), FP8_ITERS, extra + [EP, "2"]))
    src = str(tmp_path / "src")
    first = ranks_trajectory(2, "pretrain_gpt", _argv(src, FP8_ITERS, extra + [EP, "2", "--exit-interval", "2"]))
    same = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "same"), FP8_ITERS, extra + [EP, "2", "--load", src]))
    assert_same_trajectory(first + same, straight, rtol=0)  # bit-identical
    single = run_script("pretrain_gpt", _argv(str(tmp_path / "single"), FP8_ITERS, extra))
    ep1 = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "ep1"), FP8_ITERS, extra + ["--load", src, "--no-load-rng"]))
    assert_same_trajectory(first + ep1, single, rtol=1e-3, grad_rtol=MOE_GRAD_RTOL, steps=FP8_ITERS)


@pytest.mark.parametrize("grouped", [[], ["--moe-grouped-gemm"]], ids=["sequential", "grouped"])
def test_ep2_torch_dist_checkpoint_merges_into_the_one_process_model(tmp_path, grouped):
    """The offline merge (tools, --loader megatron) reads an EP2 torch_dist checkpoint as the full model."""
    extra = MOE + grouped + DIST
    ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "ep2"), 3, extra + [EP, "2"]))
    run_script("pretrain_gpt", _argv(str(tmp_path / "one"), 3, extra))
    _same_weights(str(tmp_path / "ep2"), str(tmp_path / "one"))
