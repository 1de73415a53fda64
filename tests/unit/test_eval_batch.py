"""--eval-global-batch-size, --eval-micro-batch-size and --start-eval-at-iter (Megatron-LM's flags):
validation read in other batch sizes gives the loss of the same samples read in the training ones;
the passes start at --start-eval-at-iter; bad values are one line naming the flag (exit 2). Through the
pipeline (eval micro-batches of their own shape) at TP2 x PP2 x DP2: tests/e2e/test_validation_sets_parallel.py."""

import glob

import pytest
import torch

import pretrain_gpt
from tests.cli_errors import parse_refused
from tests.unit.test_validation_sets import BASE, _passes, data  # noqa: F401  (data: the fixture)


def _close(got, expected):
    assert [it for it, _ in got] == [it for it, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert a == pytest.approx(b, rel=1e-5)


def test_eval_batch_sizes_read_the_same_samples_as_the_training_ones(data, tmp_path):  # noqa: F811
    """BASE validates 2 iterations of the global batch 4 (micro-batch 2) per pass: 8 samples from the
    saved position. Read as 1 iteration of 8 in micro-batches of 1, or as 4 iterations of 2, the passes
    (and the test pass at the end: the same 8 first samples of the test split) give the same losses; the
    checkpoint's validation position advances by eval-iters x eval-global-batch-size (8 per pass)."""
    (paths, cache) = data
    run = BASE + cache + ["--train-data-path", paths["a"], "--valid-data-path", paths["b"],
                          "--test-data-path", paths["c"]]
    reference = pretrain_gpt.main(run)
    for extra in (["--eval-global-batch-size", "8", "--eval-micro-batch-size", "1", "--eval-iters", "1"],
                  ["--eval-global-batch-size", "2", "--eval-iters", "4"]):
        save = str(tmp_path / extra[1])
        got = pretrain_gpt.main(run + extra + ["--save", save])
        assert got.losses == reference.losses  # training is untouched
        _close(_passes(got, "validation"), _passes(reference, "validation"))
        _close(_passes(got, "test"), _passes(reference, "test"))
        [path] = glob.glob(save + "/iter_0000004/mp_rank_00*/*.pt")
        assert torch.load(path, weights_only=False)["consumed_valid_samples"] == 2 * 8


def test_no_validation_pass_before_start_eval_at_iter(data):  # noqa: F811
    (paths, cache) = data
    run = BASE + cache + ["--train-data-path", paths["a"], "--valid-data-path", paths["b"], "--eval-interval", "1"]
    every = pretrain_gpt.main(run)
    late = pretrain_gpt.main(run + ["--start-eval-at-iter", "3"])
    assert late.losses == every.losses
    assert [it for it, _ in _passes(every, "validation")] == [1, 2, 3, 4]
    assert [it for it, _ in _passes(late, "validation")] == [3, 4]


@pytest.mark.parametrize("extra, words", [
    (["--eval-global-batch-size", "3"], ["--eval-global-batch-size: the eval global batch 3 is not divisible by "
                                         "the eval micro-batch 2 x data-parallel size 1"]),
    (["--eval-micro-batch-size", "3"], ["--eval-micro-batch-size: the eval global batch 4 is not divisible"]),
    (["--eval-micro-batch-size", "0"], ["--eval-micro-batch-size must be positive, got 0"]),
    (["--eval-global-batch-size", "-4"], ["--eval-global-batch-size must be positive, got -4"]),
    (["--start-eval-at-iter", "-1"], ["--start-eval-at-iter must be at least 0, got -1"]),
    (["--lr-warmup-init", "-0.1"], ["--lr-warmup-init must be at least 0, got -0.1"]),
    (["--lr-warmup-init", "1e-5"], ["--lr-warmup-init 1e-05 is where the warmup starts and this run has none",
                                    "add --lr-warmup-iters"]),
])
def test_bad_values_are_refused_in_one_line(capsys, extra, words):
    parse_refused(capsys, BASE + ["--mock-data"] + extra, *words)


def test_eval_global_batch_not_divisible_by_data_parallel_is_refused(capsys):
    parse_refused(capsys, BASE + ["--mock-data", "--global-batch-size", "8", "--eval-global-batch-size", "6",
                                  "--eval-micro-batch-size", "1"],
                  "--eval-global-batch-size: the eval global batch 6 is not divisible by the eval micro-batch 1 x "
                  "data-parallel size 4", world_size=4)


def test_interleaved_eval_micro_batches_not_a_multiple_of_pp_are_refused(capsys):
    parse_refused(capsys, BASE + ["--mock-data", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                  "--num-layers-per-virtual-pipeline-stage", "1", "--eval-global-batch-size", "6"],
                  "--eval-global-batch-size 6: the interleaved pipeline schedule needs the eval micro-batches",
                  "= 3) to be a multiple of --pipeline-model-parallel-size 2", world_size=2)
