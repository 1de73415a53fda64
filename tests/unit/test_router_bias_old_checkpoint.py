"""MoE checkpoints saved before the router had a bias (``mlp.router.bias``, biases on): every loader
takes them with the bias at zero, which computes what they were saved with; their optimizer state
(which lacks that parameter's) is refused in one line naming --no-load-optim; any other missing tensor
is still refused. The old checkpoints are written by this code with the router's bias taken away."""

import glob

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint.format import (
    CHECKSUMS_KEY,
    CheckpointError,
    atomic_save,
    read_model_file,
    with_checksums,
)
from megatron_lite.inference.loading import load_model
from megatron_lite.moe.router import TopKRouter
from tests.e2e.test_pretrain_gpt import _argv, _one_line_exit_2
from tests.tools import load_tool
from tests.trajectory import run_script

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--num-layers", "2"]


def _old_router(monkeypatch):
    init = TopKRouter.__init__

    def without_bias(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.bias = None

    monkeypatch.setattr(TopKRouter, "__init__", without_bias)


@pytest.fixture(scope="module", params=["torch", "torch_dist"])
def old(request, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("old") / "ckpt")
    with pytest.MonkeyPatch.context() as mp:
        _old_router(mp)
        pretrain_gpt.main(_argv(save, 3, MOE + ["--ckpt-format", request.param]))
    return save, request.param


def test_resume_and_finetune_take_it_with_a_zero_bias(old, tmp_path, capsys):
    save, fmt = old
    _one_line_exit_2(capsys, _argv(str(tmp_path / "a"), 5, MOE + ["--load", save, "--ckpt-format", fmt]),
                     "router bias", "--no-load-optim")
    resumed = run_script("pretrain_gpt", _argv(str(tmp_path / "b"), 5, MOE + ["--load", save, "--no-load-optim",
                                                                               "--ckpt-format", fmt]))
    # the same weights with the bias present (the converter fills it) resume alike
    convert = load_tool("checkpoint/convert").main
    assert convert(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", save,
                    "--save-dir", str(tmp_path / "new")]) == 0
    assert "loading 2 as zero" in capsys.readouterr().out
    with_bias = run_script("pretrain_gpt", _argv(str(tmp_path / "c"), 5, MOE + ["--load", str(tmp_path / "new"),
                                                                                 "--no-load-optim", "--no-load-rng"]))
    assert resumed.losses == with_bias.losses and len(resumed.losses) == 2
    tuned = run_script("pretrain_gpt", _argv(str(tmp_path / "d"), 3, MOE + ["--pretrained-checkpoint", save]))
    assert len(tuned.losses) == 3


def test_generation_takes_it(old):
    model, _ = load_model(old[0])
    assert all(torch.equal(layer.mlp.router.bias, torch.zeros(4)) for layer in model.decoder.layers)


def test_another_missing_tensor_is_still_refused(old, tmp_path, capsys):
    save, fmt = old
    if fmt != "torch":
        pytest.skip("the torch format's files are edited here")
    import shutil

    broken = str(tmp_path / "broken")
    shutil.copytree(save, broken)
    for path in glob.glob(f"{broken}/iter_*/mp_rank_*/model_optim_rng.pt"):
        payload = read_model_file(path)
        payload.pop(CHECKSUMS_KEY, None)
        del payload["model"][0]["decoder.layers.1.mlp.router.weight"]
        atomic_save(with_checksums(payload), path)
    _one_line_exit_2(capsys, _argv(str(tmp_path / "a"), 5, MOE + ["--load", broken, "--no-load-optim"]),
                     "decoder.layers.1.mlp.router.weight")
    with pytest.raises(CheckpointError, match="decoder.layers.1.mlp.router.weight"):  # not a bare KeyError
        load_model(broken)
