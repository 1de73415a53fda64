"""--no-save-optim / --no-save-rng through pretrain_gpt.py, both formats: the checkpoint holds no
optimizer state (nor schedule) / no RNG state; resuming it for training is refused in one line
naming --no-load-optim / --no-load-rng (exit 2) until told, then continues from the saved weights
(the first resumed loss is the uninterrupted run's); with only --no-save-rng the optimizer is saved
and the resumed run continues exactly; --finetune takes such a checkpoint's weights."""

import os

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint.format import rng_file
from tests.e2e.test_pretrain_gpt import MODEL, _argv, _one_line_exit_2
from tests.trajectory import Trajectory

ITERS = 4


def _saved(tmp_path, fmt, parts):
    src = str(tmp_path / "src")
    pretrain_gpt.main(_argv(src, ITERS, MODEL + ["--ckpt-format", fmt, "--exit-interval", "2"] + parts))
    return src, os.path.join(src, "iter_0000002")


def _resume(tmp_path, src, fmt, extra):
    result = pretrain_gpt.main(_argv(str(tmp_path / "next"), ITERS, MODEL + ["--ckpt-format", fmt, "--load", src]
                                     + extra))
    return Trajectory.of(result), result


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_checkpoint_without_optimizer_and_rng_needs_the_no_load_flags(tmp_path, capsys, fmt):
    full = Trajectory.of(pretrain_gpt.main(_argv(str(tmp_path / "full"), ITERS, MODEL + ["--ckpt-format", fmt])))
    src, folder = _saved(tmp_path, fmt, ["--no-save-optim", "--no-save-rng"])
    if fmt == "torch":
        assert not os.path.exists(rng_file(src, 2, 0))
        payload = torch.load(os.path.join(folder, "mp_rank_00_000", "model_optim_rng.pt"), weights_only=False)
        assert payload["optimizer"] is None and payload["scheduler"] is None
    else:
        assert not os.path.exists(os.path.join(folder, "rng"))
        common = torch.load(os.path.join(folder, "common.pt"), weights_only=False)
        assert common["optimizer"] is None and common["scheduler"] is None
    argv = _argv(str(tmp_path / "x"), ITERS, MODEL + ["--ckpt-format", fmt, "--load", src])
    capsys.readouterr()
    _one_line_exit_2(capsys, argv, "has no optimizer state", "--no-load-optim", "--finetune")
    _one_line_exit_2(capsys, argv + ["--no-load-optim"], "has no RNG state (saved with --no-save-rng)",
                     "--no-load-rng", "--finetune")
    resumed, result = _resume(tmp_path, src, fmt, ["--no-load-optim", "--no-load-rng"])
    assert result.iteration == ITERS and resumed.losses[0] == full.losses[2]  # the saved weights (dropout 0)
    tuned, result = _resume(tmp_path, src, fmt, ["--finetune"])
    assert result.iteration == ITERS and len(tuned.losses) == ITERS


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_without_rng_the_optimizer_is_saved_and_the_run_continues_exactly(tmp_path, capsys, fmt):
    full = Trajectory.of(pretrain_gpt.main(_argv(str(tmp_path / "full"), ITERS, MODEL + ["--ckpt-format", fmt])))
    src, _ = _saved(tmp_path, fmt, ["--no-save-rng"])
    capsys.readouterr()
    _one_line_exit_2(capsys, _argv(str(tmp_path / "x"), ITERS, MODEL + ["--ckpt-format", fmt, "--load", src]),
                     "--no-load-rng")
    resumed, _ = _resume(tmp_path, src, fmt, ["--no-load-rng"])
    assert resumed.losses == full.losses[2:] and resumed.grad_norms == full.grad_norms[2:]


def test_zero3_bf16_resumed_without_optimizer_steps_from_the_loaded_weights_in_both_formats(tmp_path):
    """ZeRO-3 with bf16 params keeps fp32 masters apart from the param shards: --no-load-optim must refill
    them from the loaded weights. torch_dist refilled them inside the load, before the loaded values
    reached the shards, so its first resumed step went on from the freshly initialised weights (its
    second loss far from the torch format's). Both formats now continue the same trajectory."""
    zero3 = ["--bf16", "--data-parallel-sharding-strategy", "optim_grads_params"]
    runs = {}
    for fmt in ("torch", "torch_dist"):
        src, _ = _saved(tmp_path / fmt, fmt, zero3 + ["--no-save-optim"])
        runs[fmt] = _resume(tmp_path / fmt, src, fmt, zero3 + ["--no-load-optim", "--no-load-rng"])[0]
    assert len(runs["torch"].losses) == ITERS - 2
    assert runs["torch_dist"] == runs["torch"]  # the same weights and fresh optimizer: bit for bit
