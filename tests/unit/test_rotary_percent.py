"""--rotary-percent (Megatron-LM's: the first int(head size x percent) channels of every head get the
rotary embedding, the rest pass through): the model against the independent reference of
test_gpt_model.py (fp32 rtol 1e-5), the fused rope equal to the plain one, and the refusals. TP2 and
CP2: tests/distributed (variant P); cached decoding: tests/unit/test_inference_engine.py (partial_rope)."""

import dataclasses
import json

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused
from tests.convert_helpers import convert
from tests.inference_helpers import save_model
from tests.model_helpers import build_gpt
from tests.unit.test_gpt_model import _close, make_batch, make_config, reference_logits


@pytest.mark.parametrize("percent", [0.5, 0.25])
def test_partial_rotary_matches_the_reference(percent):
    cfg = make_config("P", hidden_size=64, rotary_percent=percent)  # head size 8: 4 or 2 channels rotate
    model = build_gpt(cfg, ParallelState(), seed=7)
    tokens, _ = make_batch()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    logits = model(tokens)
    _close(logits, reference_logits(sd, cfg, tokens), "logits")
    full = reference_logits(sd, dataclasses.replace(cfg, rotary_percent=1.0), tokens)
    assert (logits - full).abs().max() > 1e-3  # the pass-through channels really are not rotated


def test_fused_rope_rotates_the_same_part():
    cfg = make_config("P")
    tokens, labels = make_batch(1)
    losses = []
    for fused in (False, True):
        model = GPTModel(TransformerConfig.from_model(cfg, seed=5, apply_rope_fusion=fused), ParallelState())
        losses.append(model(tokens, labels=labels))
    _close(losses[1], losses[0], "fused vs plain rope")


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--position-embedding-type", "rope"]  # head size 8


def test_flag_parses_with_megatrons_default():
    assert parse_args(BASE, world_size=1).model.rotary_percent == 1.0
    assert parse_args(BASE + ["--rotary-percent", "0.5"], world_size=1).model.rotary_percent == 0.5


@pytest.mark.parametrize("extra, words", [
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1]"),
    (["--rotary-percent", "1.5"], "--rotary-percent must be in (0, 1]"),
    (["--rotary-percent", "0.4"], "gives 3 rotary channels"),
    (["--rotary-percent", "0.5", "--position-embedding-type", "learned_absolute"], "--position-embedding-type rope"),
    (["--rotary-percent", "0.5", "--multi-latent-attention"], "--multi-latent-attention"),
])
def test_bad_values_exit_2_naming_the_flag(extra, words, capsys):
    parse_refused(capsys, BASE + extra, words, world_size=1)


@pytest.mark.parametrize("style", ["auto", "llama", "qwen2"])
def test_hugging_face_export_refuses_partial_rotary(style, tmp_path, capsys):
    """transformers' llama-style attention rotates every channel: the export is refused, not approximated."""
    save_model("partial_rope", str(tmp_path / "mega"))
    assert convert("GPT", "--saver", "hf", "--hf-style", style, "--load-dir", tmp_path / "mega",
                   "--save-dir", tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("--rotary-percent 0.5" in err or "--add-qkv-bias" in err), err
    assert not (tmp_path / "hf").exists()


def test_hugging_face_import_refuses_a_partial_rotary_factor(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=16)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "partial_rotary_factor": 0.5}))
    capsys.readouterr()
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "partial_rotary_factor 0.5" in err, err
