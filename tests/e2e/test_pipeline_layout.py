"""--pipeline-model-parallel-layout through pretrain_gpt.py: uneven and interleaved layouts reproduce
the single-process run, resume bit for bit, and convert to other layouts.

The stages a layout names get exactly the layers it places (:func:`pipeline_ranges`, the one source
of every consumer's ranges); stages holding only the embedding or only the loss (the output layer)
are pipeline stages like the others. Same seed, batch and fp32 as ``test_pretrain_gpt.py``: every
step's loss and gradient norm within a relative 1e-5 of one process, the final weights as there.
"""

import os

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import merge_checkpoint
from tests.e2e.test_pretrain_gpt import MODEL_B, _argv, _single
from tests.tools import load_tool
from tests.trajectory import Trajectory, assert_same_trajectory, assert_same_weights, ranks_trajectories

ITERS = 6
PP4_UNEVEN = ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "E|tt|t|tL"]
# rank 0 holds "Et" then "tt", rank 1 "t" then only the loss: uneven chunks, an empty last chunk
PP2_INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|tt|L"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _single(tmp_path_factory.mktemp("ref"), "single", ITERS, MODEL_B)


def test_uneven_layout_at_pp4_equals_one_process(tmp_path, reference):
    ref, ref_save = reference
    save = str(tmp_path / "pp4")
    [got] = ranks_trajectories(4, "pretrain_gpt", [_argv(save, ITERS, MODEL_B + PP4_UNEVEN)])
    assert_same_trajectory(got, ref, steps=ITERS, what="PP4 E|tt|t|tL")
    assert_same_weights(save, ref_save)
    payload = torch.load(os.path.join(save, f"iter_{ITERS:07d}", "mp_rank_00_001", "model_optim_rng.pt"),
                         weights_only=False)
    assert [tuple(r) for r in payload["layer_ranges"]] == [(0, 2)]


def test_interleaved_layout_equals_one_process_resumes_and_converts(tmp_path, reference):
    ref, ref_save = reference
    straight, half = str(tmp_path / "straight"), str(tmp_path / "half")
    runs = ranks_trajectories(2, "pretrain_gpt", [
        _argv(straight, ITERS, MODEL_B + PP2_INTERLEAVED),
        _argv(half, ITERS, MODEL_B + PP2_INTERLEAVED + ["--exit-interval", "3"]),
        _argv(str(tmp_path / "rest"), ITERS, MODEL_B + PP2_INTERLEAVED + ["--load", half]),
    ])
    assert_same_trajectory(runs[0], ref, steps=ITERS, what="PP2 Et|t|tt|L")
    assert_same_weights(straight, ref_save)
    assert_same_trajectory(runs[1] + runs[2], runs[0], rtol=0, what="resumed")  # bit for bit
    for rank, ranges in (("000", [(0, 1), (2, 4)]), ("001", [(1, 2), (4, 4)])):  # the layout's chunks were built
        saved = torch.load(os.path.join(half, "iter_0000003", f"mp_rank_00_{rank}", "model_optim_rng.pt"),
                           weights_only=False)
        assert [tuple(r) for r in saved["layer_ranges"]] == ranges and saved["vpp_size"] == 2

    # the converter writes the step-3 checkpoint at one process and at PP4 with another layout ...
    convert = load_tool("checkpoint/convert").main
    pp1, pp4 = str(tmp_path / "pp1"), str(tmp_path / "pp4")
    base = ["--model-type", "GPT", "--load-dir", half]
    assert convert(base + ["--save-dir", pp1, "--target-pipeline-parallel-size", "1"]) == 0
    assert convert(base + ["--save-dir", pp4, "--target-pipeline-parallel-size", "4",
                           "--target-pipeline-model-parallel-layout", "E|tt|t|tL"]) == 0
    want, _ = merge_checkpoint(half)
    for folder in (pp1, pp4):
        got, saved = merge_checkpoint(folder)
        assert got.keys() == want.keys(), folder
        for k in want:  # the vocabulary's real rows (the converter writes the padded ones as zeros)
            assert torch.equal(got[k][:123], want[k][:123]), (folder, k)
    assert saved["pipeline_model_parallel_layout"] == "E|tt|t|tL"
    first = torch.load(os.path.join(pp4, "iter_0000003", "mp_rank_00_000", "model_optim_rng.pt"), weights_only=False)
    assert [tuple(r) for r in first["layer_ranges"]] == [(0, 0)]  # the embedding alone
    # ... and the one-process copy resumes on the run's own trajectory
    resumed = pretrain_gpt.main(_argv(str(tmp_path / "b"), ITERS, MODEL_B + ["--load", pp1, "--no-load-rng"]))
    assert resumed.iteration == ITERS
    assert_same_trajectory(Trajectory.of(resumed), runs[0][3:], steps=ITERS - 3, what="converted to PP1")


def test_torch_dist_checkpoint_resumes_at_another_split(tmp_path, reference):
    """A torch_dist checkpoint saved with the even PP2 split resumes with a layout (3 + 1 layers) and
    follows the single-process run (within rounding: the docs' note says not bit for bit)."""
    ref, _ = reference
    save = str(tmp_path / "even")
    dist = ["--ckpt-format", "torch_dist", "--pipeline-model-parallel-size", "2"]
    runs = ranks_trajectories(2, "pretrain_gpt", [
        _argv(save, ITERS, MODEL_B + dist + ["--exit-interval", "3"]),
        _argv(str(tmp_path / "layout"), ITERS, MODEL_B + dist + ["--load", save,
                                                                 "--pipeline-model-parallel-layout", "Ettt|tL"]),
    ])
    assert_same_trajectory(runs[0] + runs[1], ref, steps=ITERS, what="torch_dist, even then Ettt|tL")
