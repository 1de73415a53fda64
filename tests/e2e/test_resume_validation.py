"""A resumed run's validation continues where the uninterrupted run's would be (Megatron's
consumed-validation-samples rule), so its validation losses are the uninterrupted run's."""

import pretrain_gpt
from tests.e2e.test_pretrain_gpt import MODEL


def _flags(save, *extra):
    flags = list(MODEL)
    flags[flags.index("--eval-iters") + 1] = "2"  # 2 validation batches every 2 iterations
    return flags + ["--eval-interval", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
                    "--train-iters", "6", "--save", save, *extra]


def test_resumed_validation_equals_the_uninterrupted_runs(tmp_path):
    full = pretrain_gpt.main(_flags(str(tmp_path / "full")))
    part = str(tmp_path / "part")
    first = pretrain_gpt.main(_flags(part, "--exit-interval", "4"))
    resumed = pretrain_gpt.main(_flags(part, "--load", part))
    assert [i for i, _ in full.validation] == [2, 4, 6]
    assert first.validation == full.validation[:2]
    assert resumed.losses == full.losses[4:]  # the training itself continues exactly
    # validation at 6 reads the batches after the 2 x 2 already read (not the first ones again)
    assert resumed.validation == full.validation[2:]


def test_consumed_validation_samples():
    from megatron_lite.data.builder import consumed_valid_samples

    assert consumed_valid_samples(7, global_batch_size=4, eval_interval=2, eval_iters=3) == 3 * 3 * 4
    assert consumed_valid_samples(1, 4, 2, 3) == 0  # no evaluation yet
    assert consumed_valid_samples(8, 4, 2, 0) == 0  # --eval-iters 0: evaluation off
