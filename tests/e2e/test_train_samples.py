"""pretrain_gpt.py with --train-samples: it trains train-samples // global-batch-size iterations on the
schedule the equivalent --train-iters run follows, and a checkpoint resumes exactly (in the same mode)."""

import pytest

import pretrain_gpt
from tests.e2e.test_pretrain_gpt import MODEL, _one_line_exit_2
from tests.trajectory import Trajectory

WARMUP = MODEL.index("--lr-warmup-iters")
BASE = MODEL[:WARMUP] + MODEL[WARMUP + 2:] + ["--micro-batch-size", "2", "--global-batch-size", "8"]
BY_ITERS = ["--train-iters", "4", "--lr-warmup-iters", "2"]
BY_SAMPLES = ["--train-samples", "37", "--lr-warmup-samples", "16", "--lr-decay-samples", "32"]  # 4 x 8 (+5 unused)


def _run(save, flags):
    return pretrain_gpt.main(BASE + ["--save", str(save)] + flags)


def test_train_samples_trains_its_iterations_and_resumes_exactly(tmp_path, capsys):
    by_iters = _run(tmp_path / "iters", BY_ITERS)
    whole = _run(tmp_path / "whole", BY_SAMPLES)
    assert whole.iteration == 4 and whole.consumed_samples == 32
    # the same learning rate at every step as the iteration schedule: the same losses, bit for bit
    assert whole.losses == by_iters.losses and whole.grad_norms == by_iters.grad_norms
    assert whole.optimizer.param_groups[0]["lr"] == by_iters.optimizer.param_groups[0]["lr"]
    first = _run(tmp_path / "part", BY_SAMPLES + ["--exit-interval", "2"])
    assert first.iteration == 2
    rest = _run(tmp_path / "rest", BY_SAMPLES + ["--load", str(tmp_path / "part")])
    assert rest.iteration == 4 and rest.consumed_samples == 32
    resumed = Trajectory.of(first) + Trajectory.of(rest)
    assert resumed == Trajectory.of(whole)
    assert rest.optimizer.param_groups[0]["lr"] == whole.optimizer.param_groups[0]["lr"]
    # a checkpoint counted in iterations does not continue in samples
    _one_line_exit_2(capsys, BASE + ["--save", str(tmp_path / "x"), "--load", str(tmp_path / "iters")] + BY_SAMPLES,
                     "counts iterations, this run's samples", "--train-iters")


class _Stop(Exception):
    pass


def test_the_data_sets_are_sized_from_train_samples(tmp_path, monkeypatch):
    asked = []

    def capture(config, samples, tokenizer=None):
        asked.append(list(samples))
        raise _Stop

    monkeypatch.setattr(pretrain_gpt, "build_train_valid_test_datasets", capture)
    with pytest.raises(_Stop):
        _run(tmp_path / "x", BY_SAMPLES + ["--eval-iters", "1", "--eval-interval", "2"])
    # 37 train samples (not 4 iterations x 8 = 32); validation: (4 // 2 + 1) x 1 global batch of 8
    assert asked == [[37, 24, 0]]
