"""Hugging Face ``gpt_oss`` import and export (tools/checkpoint/convert.py) against ``transformers``: a tiny
random GptOss model built from a config (no download) with every parameter perturbed (sinks, router and
expert biases), grouped-query attention, a head size other than hidden / heads, alternating sliding-window
and full layers, YaRN with gpt-oss's fractional correction range (truncate false). Imported at TP2 (x EP2)
it gives transformers' logits (fp32, atol 1e-4: logits up to ~10); exported back it is the same tensors bit for bit and
computes the same logits; what either side cannot express is refused in one line (exit 2)."""

import json
import shlex

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint import load_gpt_checkpoint
from megatron_lite.checkpoint.hf_gptoss import check_gptoss, deinterleave, interleave
from megatron_lite.errors import ConfigError
from tests.convert_helpers import convert

transformers = pytest.importorskip("transformers")

VOCAB = 100
TOKENS = torch.tensor([[5, 17, 42, 8, 61, 3, 99, 0, 12, 77, 31, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


def gptoss(rope=None, tied=False, **over):
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=12, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
              max_position_embeddings=256, rope_parameters=dict(rope or YARN), tie_word_embeddings=tied, **over)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**kw))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # the biases and sinks too (they start at 0)
    return model.eval()


def _flags(capsys) -> list[str]:
    out = capsys.readouterr().out
    return shlex.split(out.split("load it with: ")[1].split(" (and the tokenizer flags)")[0])[2:]


def _import_export(model, tmp_path, capsys, *extra):
    model.save_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "mega"
    capsys.readouterr()
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--target-tensor-parallel-size", 2, "--make-vocab-size-divisible-by", 8, *extra) == 0
    flags = _flags(capsys)
    ours, _ = load_gpt_checkpoint(str(out))
    with torch.no_grad():
        expected = model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-4)
    assert convert("GPT", "--saver", "hf", "--load-dir", out, "--save-dir", tmp_path / "again") == 0  # auto style
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    assert type(again) is type(model)
    want, got = model.state_dict(), again.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=1e-5, atol=1e-4)
    return flags, json.loads((tmp_path / "again" / "config.json").read_text())


@pytest.mark.parametrize("grouped", [False, True])
def test_gptoss_import_at_tp2_ep2_and_export(grouped, tmp_path, capsys):
    model = gptoss()
    flags, written = _import_export(model, tmp_path, capsys, "--target-expert-parallel-size", 2,
                                    *(["--moe-grouped-gemm"] if grouped else []))
    for flag in ("--quick-geglu", "--no-yarn-correction-range-round-to-int"):
        assert flag in flags
    assert flags[flags.index("--softmax-type") + 1] == "learnable"
    assert flags[flags.index("--window-attn-skip-freq") + 1] == "[1,0,1,0]"
    assert flags[flags.index("--window-size") + 1: flags.index("--window-size") + 3] == ["3", "0"]
    assert "--disable-bias-linear" not in flags and "--swiglu" not in flags
    config = parse_args(flags + ["--mock-data", "--vocab-size", str(VOCAB)], world_size=4)  # the flags load it
    assert config.model.activation_func_clamp_value == 7.0 and not config.model.yarn_correction_range_round_to_int
    assert written["layer_types"] == model.config.layer_types and written["sliding_window"] == 4
    assert {k: written["rope_parameters"][k] for k in YARN} == YARN


def test_plain_rope_and_tied_embeddings(tmp_path, capsys):
    """rope_type default and tie_word_embeddings true, every layer full attention."""
    model = gptoss(rope={"rope_type": "default", "rope_theta": 5000.0}, tied=True,
                   layer_types=["full_attention"] * 4)
    flags, written = _import_export(model, tmp_path, capsys)
    assert "--window-size" not in flags and "--untie-embeddings-and-output-weights" not in flags
    assert written["rope_parameters"]["rope_type"] == "default"


def test_interleaved_gate_up_layout():
    gate, up = torch.arange(6.0).view(2, 3), -torch.arange(6.0).view(2, 3)
    assert interleave(gate, up)[0].tolist() == [0.0, -0.0, 1.0, -1.0, 2.0, -2.0]
    assert torch.equal(deinterleave(interleave(gate, up)), torch.cat([gate, up], -1))


def _hf_refused(tmp_path, capsys, model=None, **config_over):
    model = model or gptoss()
    model.save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config_over}))
    capsys.readouterr()
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "m") == 2
    assert not (tmp_path / "m").exists()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("over, words", [
    ({"attention_bias": False}, "attention_bias false cannot be expressed"),
    ({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5 cannot be expressed"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "Mxfp4Config(dequantize=True)"),
    ({"rope_parameters": {**YARN, "rope_type": "longrope"}}, "rope_type 'longrope' cannot be expressed"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}},  # its own reason, not MLA's
     "partial_rotary_factor cannot be expressed (gpt-oss rotates every channel"),
])
def test_import_refuses_what_it_cannot_express(over, words, tmp_path, capsys):
    assert words in _hf_refused(tmp_path, capsys, **over)


BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_experts=4, position_embedding_type="rope",
            normalization="RMSNorm", quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
            softmax_type="learnable", disable_bias_linear=False, moe_layer_freq=1)


@pytest.mark.parametrize("over, words", [
    (dict(glu_linear_offset=0.0), "--glu-linear-offset 0.0 differs"),
    (dict(activation_func_clamp_value=None), "--activation-func-clamp-value"),
    (dict(quick_geglu=False, swiglu=True), "--quick-geglu"),
    (dict(disable_bias_linear=True), "drop --disable-bias-linear"),
    (dict(softmax_type="vanilla"), "--softmax-type learnable"),
    (dict(moe_shared_expert_intermediate_size=16), "--moe-shared-expert-intermediate-size"),
    (dict(moe_layer_freq="[1,0]"), "--moe-layer-freq"),
    (dict(window_size=[3, 2]), "--window-size 3 2"),
    (dict(use_rope_scaling=True), "--use-rope-scaling cannot be expressed in the gpt_oss format"),
    (dict(rotary_seq_len_interpolation_factor=2), "--rotary-seq-len-interpolation-factor cannot be expressed"),
])
def test_export_refuses_what_gpt_oss_cannot_express(over, words):
    with pytest.raises(ConfigError, match=words.replace("-", r"\-").replace("[", r"\[")):
        check_gptoss({**BASE, **over})
