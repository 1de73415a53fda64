"""A resumed run's validation continues where the uninterrupted run's would be (Megatron's
consumed-validation-samples rule), so its validation losses are the uninterrupted run's; on mock data,
on a blend of real data with --split read in --dataloader-type cyclic order, and on packed SFT
conversations. A finished run resumed with a larger --train-iters (the same schedule) continues as
the longer run would have where its datasets, built for more samples, keep their order."""

import pytest
import torch

import pretrain_gpt
from tests.e2e.test_pretrain_gpt import MODEL, _real_data
from tests.e2e.test_sft import sft_argv, sft_files  # noqa: F401 (a module fixture)
from tests.trajectory import Trajectory

DATA = ["mock", "blend_cyclic", "sft_packed"]


@pytest.fixture(params=DATA)
def data(request):
    """The model and data flags of one kind of data (2 validation batches every 2 iterations)."""
    if request.param == "mock":
        flags = list(MODEL)
    elif request.param.startswith("blend"):  # the sample corpus twice, weighted, and a test split
        flags = _real_data(request.getfixturevalue("sample_dataset"))
        prefix = flags[flags.index("--data-path") + 1]
        flags += ["--data-path", "0.3", prefix, "0.7", prefix, "--split", "90,8,2",
                  "--data-cache-path", str(request.getfixturevalue("tmp_path") / "cache")]
        flags += ["--dataloader-type", "cyclic"] if request.param == "blend_cyclic" else []
    else:
        flags = sft_argv(request.getfixturevalue("sft_files"), extra=["--split", "75,25,0"])
    return flags + ["--eval-iters", "2", "--eval-interval", "2", "--micro-batch-size", "2", "--global-batch-size", "4"]


def _flags(data, save, iters, *extra):
    return data + ["--train-iters", str(iters), "--save", save, *extra]


def test_resumed_validation_equals_the_uninterrupted_runs(tmp_path, data):
    full = pretrain_gpt.main(_flags(data, str(tmp_path / "full"), 6))
    part = str(tmp_path / "part")
    first = pretrain_gpt.main(_flags(data, part, 6, "--exit-interval", "4"))
    resumed = pretrain_gpt.main(_flags(data, part, 6, "--load", part))
    assert [i for i, _ in full.validation] == [2, 4, 6]
    assert first.validation == full.validation[:2]
    assert Trajectory.of(first) + Trajectory.of(resumed) == Trajectory.of(full)  # the training continues exactly
    # validation at 6 reads the batches after the 2 x 2 already read (not the first ones again)
    assert resumed.validation == full.validation[2:]


@pytest.mark.parametrize("data", ["mock", "blend", "sft_packed"], indirect=True)
def test_a_finished_run_resumed_with_more_iterations_continues_as_the_longer_run(tmp_path, data):
    """The final save of a 3-iteration run (validation at 2, and a final one at 3 that counts for
    nothing), resumed with --train-iters 6: the 6-iteration run, bit for bit, validation included.
    --lr-decay-iters 6 in both keeps one schedule (no --override-opt_param-scheduler needed). The
    datasets are built for the run's samples; here no split needs another epoch and the order is
    sequential, so it stays. (Not in --dataloader-type cyclic order over mock data, SFT or a blend,
    whose size is the run's samples, nor when a split needs more epochs: docs/checkpoints.md, as in
    Megatron-LM.)"""
    schedule = ["--lr-decay-iters", "6"]
    full = pretrain_gpt.main(_flags(data, str(tmp_path / "full"), 6, *schedule))
    part = str(tmp_path / "part")
    first = pretrain_gpt.main(_flags(data, part, 3, *schedule))
    assert first.exit_reason == "done" and first.iteration == 3
    longer = pretrain_gpt.main(_flags(data, part, 6, *schedule, "--load", part))
    assert longer.iteration == 6 and len(longer.losses) == 3
    assert Trajectory.of(first) + Trajectory.of(longer) == Trajectory.of(full)
    assert first.validation + longer.validation == full.validation  # at 2, then at 4 and 6


def test_consumed_validation_samples():
    from megatron_lite.data.builder import consumed_valid_samples

    assert consumed_valid_samples(7, global_batch_size=4, eval_interval=2, eval_iters=3) == 3 * 3 * 4
    assert consumed_valid_samples(1, 4, 2, 3) == 0  # no evaluation yet
    assert consumed_valid_samples(8, 4, 2, 0) == 0  # --eval-iters 0: evaluation off


@pytest.mark.parametrize("data", ["mock", "blend"], indirect=True)
def test_a_resume_with_a_smaller_global_batch_has_data_for_every_step(tmp_path, data, capsys):
    """A checkpoint saved at a global batch of 8 (3 iterations: 24 samples consumed), resumed at 4
    to iteration 6: the 3 steps left read samples 24-35. The training set was built for --train-iters
    x --global-batch-size = 24 samples (mock data and blends are sized exactly), so the first resumed
    step stopped with a StopIteration traceback from forward_step; it is built for the 36 now."""
    part, schedule = str(tmp_path / "part"), ["--lr-decay-iters", "6"]
    first = pretrain_gpt.main(_flags(data, part, 3, *schedule, "--micro-batch-size", "4", "--global-batch-size", "8"))
    assert first.consumed_samples == 24
    capsys.readouterr()
    resumed = pretrain_gpt.main(_flags(data, part, 6, *schedule, "--load", part))
    assert resumed.iteration == 6 and resumed.consumed_samples == 36 and len(resumed.losses) == 3
    assert "the training data is built for 36 samples" in capsys.readouterr().out


def test_a_train_samples_run_resumed_with_a_smaller_global_batch_ends_at_its_samples(tmp_path):
    """--train-samples 40 stopped after 4 iterations of 8 (32 consumed), resumed at a global batch of 2:
    the run counted --train-samples / 2 = 20 iterations from the start, so 16 more steps read up to
    sample 64 of a training set of 40 and the data ran out (StopIteration). It ends at its 40 samples
    now: 4 more steps."""
    at = MODEL.index("--lr-warmup-iters")
    flags = MODEL[:at] + MODEL[at + 2:] + ["--lr-warmup-samples", "8", "--train-samples", "40",
                                           "--save", str(tmp_path / "ckpt")]
    first = pretrain_gpt.main(flags + ["--micro-batch-size", "4", "--global-batch-size", "8", "--exit-interval", "4"])
    assert (first.iteration, first.consumed_samples) == (4, 32)
    resumed = pretrain_gpt.main(flags + ["--micro-batch-size", "2", "--global-batch-size", "2",
                                         "--load", str(tmp_path / "ckpt"), "--override-opt_param-scheduler"])
    assert (resumed.iteration, resumed.consumed_samples, len(resumed.losses)) == (8, 40, 4)


def test_a_ramp_up_run_resumed_with_a_smaller_global_batch_ends_at_its_samples(tmp_path, capsys):
    """--rampup-batch-size 2 2 8 to 8 stopped after 4 steps (2 + 2 + 4 + 8 = 16 consumed), resumed with
    --global-batch-size 4: its ramp counted 12 iterations from the start, so 8 more steps of 4 read up to
    sample 48 of a training set of 40 (StopIteration). It ends at its 40 samples now: 6 more steps."""
    at = MODEL.index("--lr-warmup-iters")
    flags = MODEL[:at] + MODEL[at + 2:] + ["--lr-warmup-samples", "8", "--train-samples", "40", "--micro-batch-size",
                                           "2", "--rampup-batch-size", "2", "2", "8", "--save", str(tmp_path / "ckpt")]
    first = pretrain_gpt.main(flags + ["--global-batch-size", "8", "--exit-interval", "4"])
    assert (first.iteration, first.consumed_samples) == (4, 16)
    capsys.readouterr()
    resumed = pretrain_gpt.main(flags + ["--global-batch-size", "4", "--load", str(tmp_path / "ckpt"),
                                         "--override-opt_param-scheduler"])
    assert (resumed.iteration, resumed.consumed_samples, len(resumed.losses)) == (10, 40, 6)
    assert "the run ends at iteration 10, once --train-samples 40 are trained" in capsys.readouterr().out


def _recording_validation(monkeypatch):
    """Every validation pass's micro-batches (their tokens), in order, as a list of passes."""
    from megatron_lite.training import loop

    evaluate, passes = loop.evaluate, []

    def recorded(config, comm, chunks, forward_step_func, data_iterator):
        read = []
        passes.append(read)

        def batches():
            for batch in data_iterator:
                read.append(batch["tokens"].clone())
                yield batch
        return evaluate(config, comm, chunks, forward_step_func, batches())

    monkeypatch.setattr(loop, "evaluate", recorded)
    monkeypatch.setattr(loop._Training, "test", lambda self, test_iter: None)  # the test pass at the end: left out
    return passes


@pytest.mark.parametrize("change, ckpt_format", [(["--eval-iters", "3"], "torch"), (["--eval-iters", "1"], "torch_dist"),
                                                 (["--eval-interval", "3"], "torch")],
                         ids=["more eval iters", "fewer eval iters torch_dist", "another eval interval"])
def test_a_resume_with_other_eval_flags_continues_validation_where_it_was(tmp_path, monkeypatch, change, ckpt_format):
    """The validation position of a resume was recomputed from the resumed run's --eval-interval and
    --eval-iters: stopped at 4 after two passes of 2 batches (16 samples), resumed with --eval-iters 3
    it started at (4 // 2) x 3 batches = 24 samples, skipping 8 the run had never read (with
    --eval-interval 3: at 8, reading 8 samples again). The checkpoint records the samples read, as
    Megatron-LM's does: the resumed validation reads the batches the uninterrupted run reads next (the
    validation set is built to hold them: with fewer --eval-iters the flags' count would wrap to its start)."""
    flags = list(MODEL) + ["--eval-iters", "2", "--eval-interval", "2", "--micro-batch-size", "2",
                           "--global-batch-size", "4", "--ckpt-format", ckpt_format]
    passes = _recording_validation(monkeypatch)
    pretrain_gpt.main(_flags(flags, str(tmp_path / "full"), 8))
    full = [batch for one in passes for batch in one]  # 4 passes of 2 x 2 micro-batches
    part = str(tmp_path / "part")
    pretrain_gpt.main(_flags(flags, part, 8, "--exit-interval", "4"))
    passes.clear()
    resumed = pretrain_gpt.main(_flags(flags, part, 8, "--load", part, *change))
    read = [batch for one in passes for batch in one]
    assert resumed.iteration == 8 and read
    want = full[8:8 + len(read)]  # the uninterrupted run's micro-batches after the 8 read by iteration 4
    assert len(want) == min(len(read), len(full) - 8)
    for got, expected in zip(read, want):
        assert torch.equal(got, expected)


def test_a_checkpoint_without_the_record_continues_by_the_flags(tmp_path, monkeypatch):
    """A checkpoint saved before the validation position was recorded: the position is what the
    resumed run's flags would have read by its iteration (Megatron-LM's rule for older checkpoints)."""
    from megatron_lite.training import loop

    flags = list(MODEL) + ["--eval-iters", "2", "--eval-interval", "2", "--micro-batch-size", "2",
                           "--global-batch-size", "4"]
    passes = _recording_validation(monkeypatch)
    pretrain_gpt.main(_flags(flags, str(tmp_path / "full"), 6, "--eval-iters", "1"))
    full = [batch for one in passes for batch in one]  # 3 passes of 1 x 2 micro-batches
    part = str(tmp_path / "part")
    save = loop.save_checkpoint
    monkeypatch.setattr(loop, "save_checkpoint", lambda *a, **k: save(*a[:8], **k))  # as before: no position saved
    pretrain_gpt.main(_flags(flags, part, 6, "--exit-interval", "4"))
    passes.clear()
    pretrain_gpt.main(_flags(flags, part, 6, "--load", part, "--eval-iters", "1"))
    read = [batch for one in passes for batch in one]
    assert len(read) == 2 and all(torch.equal(g, w) for g, w in zip(read, full[4:6]))  # (4 // 2) x 1 batch of 4
