"""--multiple-validation-sets with --full-validation at TP2 x PP2 x DP2 (8 ranks): every set's loss at
every pass equals the one-process run's (rtol 1e-5), on a set whose size is no multiple of the global
batch (every data-parallel rank evaluates the same number of batches, so no rank waits for another);
so does the test pass at the end of training (--test-data-path). The parallel run reads validation in
micro-batches of 1 (--eval-micro-batch-size; the one-process run in the training ones, 2): the same
global batches, 4 eval micro-batches per rank through the pipeline schedule."""

import pretrain_gpt
from tests.harness import run_ranks
from tests.unit.test_data_builder import write
from tests.unit.test_validation_sets import BASE


def evaluations(argv):
    """Inside a rank: the run's validation passes (empty on ranks that are not a last stage)."""
    return pretrain_gpt.main(argv).evaluations


def test_sets_and_full_validation_at_tp2_pp2_dp2_equal_one_process(tmp_path):
    a, b, c = (write(tmp_path / n, docs, seed=s) for n, docs, s in (("a", 60, 1), ("b", 40, 2), ("c", 22, 3)))
    argv = BASE + ["--global-batch-size", "8", "--attention-dropout", "0", "--hidden-dropout", "0", "--data-cache-path", str(tmp_path / "cache"), "--train-data-path",
                   a, "--valid-data-path", b, c, "--multiple-validation-sets", "--full-validation",
                   "--validation-set-names", "b", "c", "--make-vocab-size-divisible-by", "8", "--test-data-path", c]
    reference = pretrain_gpt.main(argv).evaluations
    assert [(it, name) for it, name, _ in reference] == [(2, "validation b"), (2, "validation c"),
                                                         (4, "validation b"), (4, "validation c"), (4, "test")]
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--eval-global-batch-size", "8", "--eval-micro-batch-size", "1"]
    per_rank = run_ranks(8, evaluations, argv + layout)
    last = [r for r in per_rank if r]
    assert len(last) == 4  # the last stage's ranks: TP2 x DP2
    for got in last:
        assert [(it, name) for it, name, _ in got] == [(it, name) for it, name, _ in reference]
        for (_, name, losses), (_, _, expected) in zip(got, reference):
            assert abs(losses["lm loss"] - expected["lm loss"]) <= 1e-5 * abs(expected["lm loss"]), name
