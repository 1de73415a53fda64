"""Hugging Face sliding windows through tools/checkpoint/convert.py: a tiny random ``MistralForCausalLM``
(``sliding_window`` W: our --window-size W-1 0), a ``MixtralForCausalLM`` and a ``Qwen2ForCausalLM`` whose
later layers use the window (``use_sliding_window``, ``max_window_layers``: --window-attn-skip-freq as a 0/1 list) give
the logits of transformers for sequences several times longer than the window (fp32, rtol/atol
1e-5), where full attention differs; exported again, transformers reads the same window back and
gives the same logits. Formats that cannot express a window refuse it (exit 2, naming the flag). Mixtral's
llama3 / linear RoPE scaling imports and exports the same way."""

import json
import shlex

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint import load_gpt_checkpoint
from tests.convert_helpers import convert

VOCAB = 100
TOKENS = torch.tensor([[5, 17, 42, 8, 61, 3, 98, 0, 12, 77, 31, 2, 9, 44, 23, 6],
                       [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])


def _randomized(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def _mistral(transformers, window):
    torch.manual_seed(4)
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=4, head_dim=4,
                                     max_position_embeddings=32, rope_theta=5000.0, rms_norm_eps=1e-6,
                                     sliding_window=window, tie_word_embeddings=False)
    return _randomized(transformers.MistralForCausalLM(cfg))


def _qwen2(transformers, layers=3, first_windowed=1):
    torch.manual_seed(5)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                                   rope_theta=5000.0, rms_norm_eps=1e-6, use_sliding_window=True, sliding_window=3,
                                   max_window_layers=first_windowed)
    return _randomized(transformers.Qwen2ForCausalLM(cfg))


def _round_trip(model, tmp_path, *style, capsys=None):
    """Import ``model`` with the converter, return (ours, saved config, the re-exported HF config, its model);
    with ``capsys``, the flags the converter prints parse (through a shell's word splitting) to the saved window."""
    transformers = pytest.importorskip("transformers")
    model.save_pretrained(str(tmp_path / "hf"))
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "mega",
                   "--make-vocab-size-divisible-by", 8) == 0
    if capsys is not None:
        printed = capsys.readouterr().out.split("load it with: ")[1].split(" (and the tokenizer flags)")[0]
        parsed = parse_args(shlex.split(printed) + ["--mock-data", "--vocab-size", str(VOCAB)], world_size=1).model
        assert "'[" in printed  # a list expression is quoted: a shell would glob [0,1,1]
        saved = load_gpt_checkpoint(str(tmp_path / "mega"))[1]
        assert (parsed.window_size, parsed.window_attn_skip_freq) == (saved["window_size"], saved["window_attn_skip_freq"])
    ours, saved = load_gpt_checkpoint(str(tmp_path / "mega"))
    assert convert("GPT", "--saver", "hf", *style, "--load-dir", tmp_path / "mega", "--save-dir", tmp_path / "again") == 0
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    return ours.eval(), saved, written, again


def test_mistral_window_imports_and_exports_with_transformers_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _mistral(transformers, window=4)
    ours, saved, written, again = _round_trip(model, tmp_path)
    assert saved["window_size"] == [3, 0] and saved["window_attn_skip_freq"] is None
    with torch.no_grad():
        expected = model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
        model.config.sliding_window = None  # the same weights with full attention: the window matters here
        assert (model(TOKENS).logits - expected).abs().max() > 1e-2
        assert written["model_type"] == "mistral" and written["sliding_window"] == 4
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)


def test_mistral_without_a_window_is_full_attention(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _mistral(transformers, window=None)
    ours, saved, written, _ = _round_trip(model, tmp_path, "--hf-style", "mistral")
    assert saved["window_size"] is None and written["sliding_window"] is None
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], model(TOKENS).logits, rtol=1e-5, atol=1e-5)


def test_qwen2_windowed_later_layers_import_and_export(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    model = _qwen2(transformers)  # layer 0 full, layers 1-2 windowed
    ours, saved, written, again = _round_trip(model, tmp_path, capsys=capsys)
    assert saved["window_size"] == [2, 0] and saved["window_attn_skip_freq"] == "[0,1,1]"
    with torch.no_grad():
        expected = model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
        assert written["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
        assert written["use_sliding_window"] and written["sliding_window"] == 3 and written["max_window_layers"] == 1
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)


def _mixtral(transformers, window=None, rope=None, heads=8):
    torch.manual_seed(6)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=heads, num_key_value_heads=4, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32, rms_norm_eps=1e-6,
                                     rope_parameters={"rope_theta": 5000.0, **(rope or {})}, sliding_window=window,
                                     tie_word_embeddings=False)
    return _randomized(transformers.MixtralForCausalLM(cfg))


def test_mixtral_window_imports_and_exports(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _mixtral(transformers, window=5)
    ours, saved, written, again = _round_trip(model, tmp_path)
    assert saved["window_size"] == [4, 0] and saved["num_experts"] == 4
    with torch.no_grad():
        expected = model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
        assert written["model_type"] == "mixtral" and written["sliding_window"] == 5
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)


ROPES = {  # Hugging Face rope_parameters -> our flags (the llama formats' scalings, checkpoint/hf_rope.py)
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, {"use_rope_scaling": True, "rope_scaling_factor": 8.0}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"rotary_seq_len_interpolation_factor": 4}),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_mixtral_rope_scaling_imports_and_exports(kind, tmp_path):
    """rope_type llama3 / linear in a mixtral config (refused both ways before): imported with transformers'
    logits and the flags saved, exported with the same rope_parameters and logits. Head size 8 (4 heads):
    llama3 rescales only wavelengths above 2048 positions, which theta 5000 reaches from 8 channels on."""
    transformers = pytest.importorskip("transformers")
    rope, flags = ROPES[kind]
    model, plain = _mixtral(transformers, rope=rope, heads=4), _mixtral(transformers, heads=4)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():  # the scaling changes these logits measurably
        assert (plain(TOKENS).logits - model(TOKENS).logits).abs().max() > 1e-3
    ours, saved, written, again = _round_trip(model, tmp_path)
    assert {k: saved[k] for k in flags} == flags
    assert written["model_type"] == "mixtral" and {k: written["rope_parameters"][k] for k in rope} == rope
    with torch.no_grad():
        expected = model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)


def test_formats_without_a_window_refuse_it(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    _mistral(transformers, window=4).save_pretrained(str(tmp_path / "hf"))
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "mega",
                   "--make-vocab-size-divisible-by", 8) == 0
    capsys.readouterr()
    assert convert("GPT", "--saver", "hf", "--hf-style", "llama", "--load-dir", tmp_path / "mega",
                   "--save-dir", tmp_path / "x") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--window-size 3 0" in err and "use --hf-style mistral" in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("flags,style,advice", [
    (dict(window_attn_skip_freq=2), "mistral", "convert between Megatron layouts"),  # was: use qwen2 (refuses it)
    (dict(window_attn_skip_freq=2), "qwen2", "convert between Megatron layouts"),  # was: use llama (no window)
    (dict(window_attn_skip_freq=2), "llama", "convert between Megatron layouts"),
    (dict(disable_bias_linear=False), "mistral", "convert between Megatron layouts"),
    (dict(disable_bias_linear=False), "llama", "convert between Megatron layouts"),
    (dict(window_attn_skip_freq=2, add_qkv_bias=True), "mistral", "use --hf-style qwen2"),
    (dict(), "llama", "use --hf-style mistral"),
])
def test_a_refused_window_export_points_only_at_a_format_that_takes_the_model(flags, style, advice):
    """Each refusal's advice is a format that holds the model's window and biases, or none."""
    from megatron_lite.checkpoint.hf_mistral import check_window_exportable, to_mistral
    from megatron_lite.checkpoint.hf_qwen2 import to_qwen2
    from megatron_lite.errors import ConfigError

    cfg = {**dict(num_layers=4, window_size=[3, 0], disable_bias_linear=True, add_qkv_bias=False), **flags}
    export = {"mistral": to_mistral, "qwen2": to_qwen2}.get(style, lambda c, sd: check_window_exportable(c, style))
    with pytest.raises(ConfigError) as err:
        export(cfg, {})
    assert advice in str(err.value) and "\n" not in str(err.value), str(err.value)
