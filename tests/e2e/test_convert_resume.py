"""A checkpoint trained at TP2 x PP2, converted with tools/checkpoint/convert.py, resumes in
pretrain_gpt.py at another layout and trains on exactly as it would have at the original one.

The converter writes no optimizer, scheduler or RNG state, so both continuations run with
``--no-load-optim --no-load-rng`` (a fresh optimizer and schedule at the saved iteration, the data
resuming at the saved consumed samples); every continued step's loss must agree within rel 1e-5.
"""

import pytest

import pretrain_gpt
from tests.e2e.test_pretrain_gpt import MODEL, MODEL_B, _argv, _one_line_exit_2, _ranks_losses, _same_losses
from tests.tools import load_tool

RESUME = ["--no-load-optim", "--no-load-rng"]


def test_converted_checkpoint_resumes_at_a_new_layout_like_the_original(tmp_path):
    src, tp1 = str(tmp_path / "tp2pp2"), str(tmp_path / "tp1")
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    _ranks_losses(4, _argv(src, 4, MODEL_B + layout))
    convert = load_tool("checkpoint/convert").main
    assert convert(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", src,
                    "--save-dir", tp1, "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"]) == 0

    original = _ranks_losses(4, _argv(str(tmp_path / "a"), 8, MODEL_B + layout + ["--load", src] + RESUME))
    converted = pretrain_gpt.main(_argv(str(tmp_path / "b"), 8, MODEL_B + ["--load", tp1] + RESUME))
    assert converted.iteration == 8 and len(converted.losses) == 4  # resumed at iteration 4
    _same_losses(converted.losses, original)


@pytest.mark.parametrize("flags, words", [
    (["--ckpt-format", "torch_dist"], ["--ckpt-format torch_dist is not implemented"]),
    (["--async-save"], ["--async-save"]),
    (["--auto-detect-ckpt-format"], ["--auto-detect-ckpt-format"]),
])
def test_sharded_checkpoint_flags_are_refused(capsys, flags, words):
    _one_line_exit_2(capsys, MODEL + ["--micro-batch-size", "2"] + flags, *words)
