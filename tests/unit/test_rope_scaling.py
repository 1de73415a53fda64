"""--use-rope-scaling / --rope-scaling-factor (Llama 3.1's frequency scaling, Megatron-LM's fixed
constants) and --rotary-seq-len-interpolation-factor (positions divided by the factor): the scaled
frequencies equal transformers' own llama3 rule, a Hugging Face llama with rope_type llama3 or linear
imports with the same logits (fp32 rtol/atol 1e-5) and exports back as such; the refusals. Cached
decoding: tests/unit/test_inference_engine.py (rope_scaled)."""

import json

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint import load_gpt_checkpoint
from megatron_lite.models.rope_config import llama3_inv_freq
from tests.cli_errors import parse_refused
from tests.convert_helpers import convert

VOCAB = 100
TOKENS = torch.tensor([[5, 17, 42, 8, 61, 3, 99, 0, 12, 77, 31, 2, 9, 14, 50, 6]])


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_scaled_frequencies_equal_transformers_llama3_rule(factor):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=16, rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    plain = 1.0 / (500000 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    got = llama3_inv_freq(plain, factor)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert (got != plain).sum() > 10 and (got == plain).sum() > 10  # kept, blended and divided channels


def _llama(transformers, rope: dict, tmp_path):
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   rope_parameters={"rope_theta": 500000.0, **rope})  # head size 8
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.eval().save_pretrained(str(tmp_path / "hf"))
    return model


ROPES = {
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, {"use_rope_scaling": True, "rope_scaling_factor": 8.0}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"rotary_seq_len_interpolation_factor": 4}),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_hugging_face_rope_scaling_imports_and_exports_with_the_same_logits(kind, tmp_path):
    transformers = pytest.importorskip("transformers")
    rope, flags = ROPES[kind]
    model = _llama(transformers, rope, tmp_path)
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "mega",
                   "--make-vocab-size-divisible-by", 8) == 0
    ours, saved = load_gpt_checkpoint(str(tmp_path / "mega"))
    assert {k: saved[k] for k in flags} == flags
    with torch.no_grad():
        expected = model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
        plain = _llama(transformers, {"rope_type": "default"}, tmp_path / "plain")(TOKENS).logits
    assert (plain - expected).abs().max() > 1e-3  # the scaling changes the logits measurably here
    assert convert("GPT", "--saver", "hf", "--load-dir", tmp_path / "mega", "--save-dir", tmp_path / "again") == 0
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    assert {k: written["rope_parameters"][k] for k in rope} == rope
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)


def test_llama3_constants_other_than_megatrons_are_refused(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    rope = dict(ROPES["llama3"][0], high_freq_factor=2.0)
    _llama(transformers, rope, tmp_path)
    capsys.readouterr()
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "high_freq_factor 2.0" in err, err


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--position-embedding-type", "rope"]


def test_flags_parse_with_megatrons_defaults():
    m = parse_args(BASE, world_size=1).model
    assert (m.use_rope_scaling, m.rope_scaling_factor, m.rotary_seq_len_interpolation_factor) == (False, 8.0, None)
    m = parse_args(BASE + ["--use-rope-scaling", "--rope-scaling-factor", "32", "--rotary-seq-len-interpolation-factor",
                           "1"], world_size=1).model  # 1: accepted (launch scripts pass it), no interpolation
    assert (m.use_rope_scaling, m.rope_scaling_factor, m.rotary_seq_len_interpolation_factor) == (True, 32.0, 1)


@pytest.mark.parametrize("extra, words", [
    (["--rotary-seq-len-interpolation-factor", "0"], "--rotary-seq-len-interpolation-factor must be at least 1"),
    (["--use-rope-scaling", "--rope-scaling-factor", "0"], "--rope-scaling-factor must be positive"),
    (["--use-rope-scaling", "--position-embedding-type", "learned_absolute"], "--use-rope-scaling needs"),
    (["--rotary-seq-len-interpolation-factor", "2", "--multi-latent-attention"], "--multi-latent-attention"),
])
def test_bad_values_exit_2_naming_the_flag(extra, words, capsys):
    parse_refused(capsys, BASE + extra, words, world_size=1)


def test_export_of_both_scalings_at_once_is_refused():
    from megatron_lite.checkpoint.hf_rope import rope_scaling_to_hf
    from megatron_lite.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot be expressed"):
        rope_scaling_to_hf({"use_rope_scaling": True, "rotary_seq_len_interpolation_factor": 2}, 1e4)
    assert rope_scaling_to_hf({"rotary_seq_len_interpolation_factor": 1}, 1e4)[1] is None  # 1: plain RoPE


