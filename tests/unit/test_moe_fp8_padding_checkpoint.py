"""A checkpoint trained with ``--moe-router-padding-for-fp8`` is usable by every tool that builds a
model from its saved config without FP8: generation (:func:`~megatron_lite.inference.loading.load_model`),
the one-process loader (:func:`~megatron_lite.checkpoint.merge.load_gpt_checkpoint`), the LoRA export
(:func:`~megatron_lite.lora.convert.load_lora_gpt`) and
tools/checkpoint/convert.py. The saved flag is dropped there (it only pads FP8 GEMMs' token counts and
is refused without FP8); before, each of them failed with '--moe-router-padding-for-fp8 needs FP8'.
The models built from it compute what the trained model computes without padding.
"""

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint.merge import load_gpt_checkpoint
from megatron_lite.inference.loading import load_model
from tests.e2e.test_pretrain_gpt import _argv
from tests.tools import load_tool

PADDED_FP8_MOE = ["--bf16", "--fp8-format", "hybrid", "--num-experts", "4", "--moe-router-topk", "2",
                  "--moe-token-dispatcher-type", "alltoall", "--moe-router-padding-for-fp8",
                  "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                  "--untie-embeddings-and-output-weights"]  # (Mixtral-shaped: the HF export takes it)


@pytest.fixture(scope="module")
def padded_checkpoint(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("padded") / "ckpt")
    pretrain_gpt.main(_argv(save, 3, PADDED_FP8_MOE))
    return save


def test_generation_and_one_process_loaders_build_the_padded_checkpoint(padded_checkpoint):
    served, saved = load_model(padded_checkpoint)
    assert saved["moe_router_padding_for_fp8"]  # (the checkpoint does record the flag)
    merged, _ = load_gpt_checkpoint(padded_checkpoint)
    tokens = torch.randint(0, 123, (2, 16), generator=torch.Generator().manual_seed(0))
    real = saved["vocab_size"]  # (the padded vocabulary's rows differ: the served model masks them)
    with torch.no_grad():
        torch.testing.assert_close(served.eval()(tokens)[..., :real], merged.eval()(tokens)[..., :real],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("saver, extra", [("megatron", ["--target-expert-parallel-size", "2"]), ("hf", [])])
def test_convert_takes_the_padded_checkpoint(padded_checkpoint, tmp_path, saver, extra):
    convert = load_tool("checkpoint/convert").main
    assert convert(["--model-type", "GPT", "--loader", "megatron", "--saver", saver, "--load-dir", padded_checkpoint,
                    "--save-dir", str(tmp_path / saver)] + extra) == 0


def test_lora_checkpoint_of_a_padded_run_loads_for_export(padded_checkpoint, tmp_path):
    from megatron_lite.lora.convert import load_lora_gpt

    save = str(tmp_path / "lora")
    pretrain_gpt.main(_argv(save, 3, PADDED_FP8_MOE + ["--lora-rank", "4", "--pretrained-checkpoint", padded_checkpoint]))
    model, config = load_lora_gpt(save)
    assert config["moe_router_padding_for_fp8"] and model.decoder.layers[0].mlp.token_dispatcher.pad_multiple is None
