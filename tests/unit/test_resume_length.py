"""Resuming with another run length: a note that the sample order may differ from an uninterrupted
run of the new length (docs/checkpoints.md), printed only when the length differs. A run with
nothing left to train saves the loaded iteration to another --save folder (not to its own)."""

import os

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import merge_checkpoint, read_tracker

TINY = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0",
        "--lr-decay-style", "constant"]
NOTE = "sample order may differ from that of an uninterrupted run"


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_resume_with_another_train_length_notes_the_data_order(tmp_path, capsys, fmt):
    save = str(tmp_path / "ckpt")
    argv = TINY + ["--ckpt-format", fmt, "--save", save, "--lr-decay-iters", "8"]
    pretrain_gpt.main(argv + ["--train-iters", "2"])
    assert NOTE not in capsys.readouterr().out
    pretrain_gpt.main(argv + ["--load", save, "--train-iters", "4"])
    notes = [line for line in capsys.readouterr().out.splitlines() if NOTE in line]
    assert notes == ["> note: --train-iters 4 differs from the checkpoint's run (2): the sample order may differ from "
                     "that of an uninterrupted run of 4 iterations (see \"A finished run resumed with a larger "
                     "--train-iters\" in docs/checkpoints.md)"]
    pretrain_gpt.main(argv + ["--load", save, "--train-iters", "6"])  # the checkpoint of the 4-iteration run
    assert "--train-iters 6 differs from the checkpoint's run (4)" in capsys.readouterr().out
    pretrain_gpt.main(argv + ["--load", save, "--train-iters", "6"])  # the same length: nothing to say
    assert NOTE not in capsys.readouterr().out


def test_a_resume_with_another_train_samples_notes_it_in_samples(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    argv = TINY + ["--save", save, "--lr-decay-samples", "16"]
    pretrain_gpt.main(argv + ["--train-samples", "4"])
    pretrain_gpt.main(argv + ["--load", save, "--train-samples", "8"])
    assert ("> note: --train-samples 8 differs from the checkpoint's run (4): the sample order may differ from that "
            "of an uninterrupted run of 8 samples") in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_nothing_left_to_train_saves_the_loaded_iteration_to_another_save_folder(tmp_path, capsys, fmt):
    """--load A --save B --train-iters k, A at iteration k: B stayed empty (the loaded iteration counted
    as saved, wherever --save pointed). It is written to B now, as Megatron-LM's final save writes
    an iteration that its --save-interval does not divide; --save A does not write it again."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    argv = TINY + ["--ckpt-format", fmt, "--train-iters", "3"]
    pretrain_gpt.main(argv + ["--save", a])
    capsys.readouterr()
    pretrain_gpt.main(argv + ["--load", a, "--save", a])
    assert "saving checkpoint" not in capsys.readouterr().out
    pretrain_gpt.main(argv + ["--load", a, "--save", b])
    assert f"saving checkpoint at iteration       3 to {b}" in capsys.readouterr().out
    assert read_tracker(b) == 3 and sorted(os.listdir(b)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    want, got = merge_checkpoint(a)[0], merge_checkpoint(b)[0]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
