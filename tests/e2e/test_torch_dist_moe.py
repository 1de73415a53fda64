"""--ckpt-format torch_dist with expert parallelism: experts are saved under their global numbers
(stacked grouped-GEMM weights along the global expert axis), each by expert-data-parallel rank 0 of
its expert-parallel rank, and the distributed optimizer's expert slices by every expert-DP rank. A
checkpoint saved at EP2 resumes at EP1, EP4 and TP2 with the losses of an uninterrupted
single-process run (relative 1e-5), optimizer state included; FP8 experts resume too."""

import pytest

import pretrain_gpt
from tests.e2e.test_pretrain_gpt import _argv, _same_losses, _same_weights
from tests.e2e.test_pretrain_moe import MOE
from tests.harness import run_ranks

DIST = ["--ckpt-format", "torch_dist"]
ITERS, STOP = 5, 2
EP = "--expert-model-parallel-size"


def _losses(argv):
    return pretrain_gpt.main(argv).losses


def _run(world, argv):
    losses = [r for r in run_ranks(world, _losses, argv) if r]
    assert losses and all(r == losses[0] for r in losses)
    return losses[0]


@pytest.mark.parametrize("model, save_world, save_flags, resumes", [
    # sequential experts; the distributed optimizer shards expert state over expert-DP 2, dense over DP 4
    (MOE, 4, [EP, "2", "--use-distributed-optimizer"],
     [(2, [EP, "1", "--use-distributed-optimizer"]), (4, [EP, "4", "--use-distributed-optimizer"])]),
    # grouped experts (stacked weights [E_local, ...]); plain optimizer
    (MOE + ["--moe-grouped-gemm"], 2, [EP, "2"],
     [(4, [EP, "4"]), (2, [EP, "1", "--tensor-model-parallel-size", "2", "--sequence-parallel"])]),
], ids=["sequential_ep2dp2_distopt", "grouped_ep2"])
def test_ep2_torch_dist_checkpoint_resumes_at_ep1_ep4_and_tp2(tmp_path, model, save_world, save_flags, resumes):
    src = str(tmp_path / "src")
    whole = _losses(_argv(str(tmp_path / "whole"), ITERS, model))
    first = _run(save_world, _argv(src, ITERS, model + DIST + save_flags + ["--exit-interval", str(STOP)]))
    _same_losses(first, whole[:STOP])
    for i, (world, flags) in enumerate(resumes):
        again = _run(world, _argv(str(tmp_path / f"r{i}"), ITERS, model + DIST + flags + ["--load", src, "--no-load-rng"]))
        assert len(first + again) == len(whole), flags
        _same_losses(first + again, whole)


def test_ep2_fp8_grouped_torch_dist_resumes_exactly_and_at_ep1(tmp_path):
    """FP8 experts' amax histories and scales are saved per global expert: resuming at EP2 continues
    bit for bit, and the checkpoint loads at EP1 (FP8 tolerance, relative 1e-3)."""
    extra = ["--bf16", "--fp8-format", "hybrid"] + MOE + ["--moe-grouped-gemm"] + DIST
    straight = _run(2, _argv(str(tmp_path / "straight"), 4, extra + [EP, "2"]))
    src = str(tmp_path / "src")
    first = _run(2, _argv(src, 4, extra + [EP, "2", "--exit-interval", "2"]))
    same = _run(2, _argv(str(tmp_path / "same"), 4, extra + [EP, "2", "--load", src]))
    assert first + same == straight
    ep1 = _run(2, _argv(str(tmp_path / "ep1"), 4, extra + ["--load", src, "--no-load-rng"]))
    assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(first + ep1, straight))


@pytest.mark.parametrize("grouped", [[], ["--moe-grouped-gemm"]], ids=["sequential", "grouped"])
def test_ep2_torch_dist_checkpoint_merges_into_the_one_process_model(tmp_path, grouped):
    """The offline merge (tools, --loader megatron) reads an EP2 torch_dist checkpoint as the full model."""
    extra = MOE + grouped + DIST
    _run(2, _argv(str(tmp_path / "ep2"), 3, extra + [EP, "2"]))
    _losses(_argv(str(tmp_path / "one"), 3, extra))
    _same_weights(str(tmp_path / "ep2"), str(tmp_path / "one"))
