"""Hugging Face ``qwen3`` / ``qwen3_moe`` import and export (tools/checkpoint/convert.py) against ``transformers``:
tiny random models built from a config (no download) with random q/k norm weights, a head size other
than hidden / heads (--kv-channels), grouped-query attention. Imported (TP2, EP2) they give
transformers' logits (fp32, rtol/atol 1e-5); exported back they are the same tensors bit for bit; the
printed flags include --qk-layernorm and load the checkpoint through --pretrained-checkpoint; what
the formats cannot express is refused in one line."""

import json
import shlex
import subprocess

import pytest
import torch

import pretrain_gpt
from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint import load_gpt_checkpoint, merge_checkpoint
from megatron_lite.checkpoint.hf_mixtral import to_mixtral
from megatron_lite.checkpoint.hf_qwen3 import _qwen3_moe_config, to_qwen3, to_qwen3_moe
from megatron_lite.errors import ConfigError
from tests.cli_errors import refused_line
from tests.convert_helpers import convert

transformers = pytest.importorskip("transformers")

VOCAB = 100
TOKENS = torch.tensor([[5, 17, 42, 8, 61, 3, 99, 0, 12, 77, 31, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=12, max_position_embeddings=16, rms_norm_eps=1e-6)


def _perturbed(model):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # the q/k norm weights too (they start at 1)
    return model.eval()


def qwen3(tied=False, rope=None):
    cfg = transformers.Qwen3Config(intermediate_size=48, rope_parameters={"rope_theta": 5000.0, **(rope or {})},
                                   tie_word_embeddings=tied, **COMMON)
    return _perturbed(transformers.Qwen3ForCausalLM(cfg))


def qwen3_moe(norm_topk_prob=True, mlp_only_layers=(1,), step=1, rope=None):
    cfg = transformers.Qwen3MoeConfig(intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, decoder_sparse_step=step,
                                      mlp_only_layers=list(mlp_only_layers), tie_word_embeddings=False,
                                      rope_parameters={"rope_theta": 10000.0, **(rope or {})}, **COMMON)
    return _perturbed(transformers.Qwen3MoeForCausalLM(cfg))


def _flags(capsys) -> list[str]:
    out = capsys.readouterr().out
    return shlex.split(out.split("load it with: ")[1].split(" (and the tokenizer flags)")[0])[2:]  # without --load DIR


def _import_export(model, tmp_path, capsys, *extra):
    """Import at TP2 (+extra), compare logits, export back and compare tensors; the printed flags."""
    model.save_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "mega"
    capsys.readouterr()
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--target-tensor-parallel-size", 2, "--make-vocab-size-divisible-by", 8, *extra) == 0
    flags = _flags(capsys)
    assert "--qk-layernorm" in flags and flags[flags.index("--kv-channels") + 1] == "12"
    ours, saved = load_gpt_checkpoint(str(out))
    assert saved["qk_layernorm"] and saved["kv_channels"] == 12
    with torch.no_grad():
        expected = model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
    assert convert("GPT", "--saver", "hf", "--load-dir", out, "--save-dir", tmp_path / "again") == 0  # auto style
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    assert written["model_type"] == model.config.model_type
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    assert type(again) is type(model)
    want, got = model.state_dict(), again.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    with torch.no_grad():  # and the config.json written computes the same model (routing, norms, head size)
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)
    return out, flags


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_import_at_tp2_and_export(tied, tmp_path, capsys):
    model = qwen3(tied)
    out, flags = _import_export(model, tmp_path, capsys)
    # each TP shard holds the whole (replicated) q/k norm weights
    name = "decoder.layers.2.self_attention.k_layernorm.weight"
    shard = torch.load(out / "release" / "mp_rank_01_000" / "model_optim_rng.pt", weights_only=True)["model"]
    shard = shard[0] if isinstance(shard, list) else shard
    assert torch.equal(shard[name], model.model.layers[2].self_attn.k_norm.weight.detach())
    assert torch.equal(merge_checkpoint(str(out))[0][name], shard[name])


@pytest.mark.parametrize("grouped, norm_topk_prob", [(False, True), (True, False)])
def test_qwen3_moe_import_at_tp2_ep2_and_export(grouped, norm_topk_prob, tmp_path, capsys):
    """Layer 1 dense (mlp_only_layers), layers 0 and 2 MoE; norm_topk_prob true is our post-top-k softmax,
    false --moe-router-pre-softmax."""
    model = qwen3_moe(norm_topk_prob)
    _, flags = _import_export(model, tmp_path, capsys, "--target-expert-parallel-size", 2,
                              *(["--moe-grouped-gemm"] if grouped else []))
    assert flags[flags.index("--moe-layer-freq") + 1] == "[1,0,1]"
    assert ("--moe-router-pre-softmax" in flags) is not norm_topk_prob
    config = parse_args(flags + ["--mock-data", "--vocab-size", str(VOCAB)], world_size=4)  # TP2 x EP2 (unfolded)
    assert config.model.qk_layernorm and config.moe.moe_router_pre_softmax is not norm_topk_prob


ROPES = {  # Hugging Face rope_parameters -> our flags (the llama formats' scalings, checkpoint/hf_rope.py)
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, {"use_rope_scaling": True, "rope_scaling_factor": 8.0}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"rotary_seq_len_interpolation_factor": 4}),
}


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_scaling_imports_and_exports_with_the_same_logits(kind, moe, tmp_path, capsys):
    """rope_type llama3 / linear in a qwen3 or qwen3_moe config (qwen3_moe refused both ways before):
    imported at TP2 with transformers' logits, the flags saved, exported back with the same rope_parameters."""
    rope, flags = ROPES[kind]
    model = qwen3_moe(rope=rope) if moe else qwen3(rope=rope)
    plain = qwen3_moe() if moe else qwen3()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():  # the scaling changes these logits measurably (max_position_embeddings 16)
        assert (plain(TOKENS).logits - model(TOKENS).logits).abs().max() > 1e-3
    _import_export(model, tmp_path, capsys)
    _, saved = load_gpt_checkpoint(str(tmp_path / "mega"))
    assert {k: saved[k] for k in flags} == flags
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    assert {k: written["rope_parameters"][k] for k in rope} == rope


def test_qwen3_moe_config_without_rope_theta_takes_transformers_default(tmp_path, capsys):
    """A qwen3_moe config.json without rope_theta (nor rope_parameters) is read with transformers' default
    10000, not Mixtral's 1e6 (the logits differed)."""
    model = qwen3_moe()
    model.save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "config.json"
    hf = json.loads(path.read_text())
    hf.pop("rope_parameters"), hf.pop("rope_theta", None)
    path.write_text(json.dumps(hf))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert again.config.rope_parameters["rope_theta"] == 10000.0
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "mega",
                   "--make-vocab-size-divisible-by", 8) == 0
    ours, saved = load_gpt_checkpoint(str(tmp_path / "mega"))
    assert saved["rotary_base"] == 10000
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], again(TOKENS).logits, rtol=1e-5, atol=1e-5)


def test_training_only_moe_options_without_a_field_are_named_in_a_warning(tmp_path, capsys, caplog):
    """--moe-input-jitter-eps (Qwen3-MoE has no router_jitter_noise), --moe-z-loss-coeff and --hidden-dropout
    (neither format has a field) only act in training: the export writes the same model and one warning names
    what it left out; Mixtral's router_jitter_noise carries the jitter, attention_dropout the attention dropout."""
    cfg, sd = _qwen3_moe_import(tmp_path, capsys)
    cfg.update(moe_input_jitter_eps=0.01, moe_z_loss_coeff=0.001, hidden_dropout=0.1, attention_dropout=0.05)
    with caplog.at_level("WARNING"):
        hf, _ = to_qwen3_moe(cfg, sd)
    assert "jitter" not in json.dumps(hf) and hf["attention_dropout"] == 0.05
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "--hidden-dropout 0.1, --moe-input-jitter-eps 0.01, --moe-z-loss-coeff 0.001"]
    caplog.clear()
    mixtral_cfg = {**cfg, "qk_layernorm": False, "moe_router_pre_softmax": False, "moe_layer_freq": 1}
    mixtral_sd = {k: v for k, v in sd.items() if "layernorm" not in k and ".layers.1.mlp" not in k}
    for k in [k for k in sd if ".layers.0.mlp" in k]:
        mixtral_sd[k.replace(".layers.0.", ".layers.1.")] = sd[k]
    with caplog.at_level("WARNING"):
        hf, _ = to_mixtral(mixtral_cfg, mixtral_sd)
    assert hf["router_jitter_noise"] == 0.01 and hf["attention_dropout"] == 0.05
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["--hidden-dropout 0.1, --moe-z-loss-coeff 0.001"]


def test_hidden_dropout_of_the_dense_llama_formats_is_named_in_a_warning(tmp_path, caplog):
    """--hidden-dropout has no field in the llama family's formats: one warning, naming the format asked for
    (qwen3 is written through the llama export); --attention-dropout is attention_dropout; none at 0."""
    from megatron_lite.checkpoint.hf import to_hf
    from megatron_lite.checkpoint.hf_folder import load_hf

    qwen3().save_pretrained(str(tmp_path / "hf"))
    bundle = load_hf(str(tmp_path / "hf"))
    cfg, sd = {**bundle.config, "hidden_dropout": 0.1, "attention_dropout": 0.05}, bundle.state_dict
    llama = {**cfg, "qk_layernorm": False}
    for style, export in (("qwen3", lambda: to_qwen3(cfg, sd)), ("llama", lambda: to_hf(llama, sd, "llama"))):
        caplog.clear()
        with caplog.at_level("WARNING"):
            hf, _ = export()
        assert hf["attention_dropout"] == 0.05
        assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
            f"--hidden-dropout 0.1: training-only, and the {style} format has no field for it; not written"]
    caplog.clear()
    with caplog.at_level("WARNING"):
        to_qwen3(bundle.config, sd)  # imported: hidden_dropout 0
    assert not caplog.records


def _qwen3_moe_import(tmp_path, capsys):
    """(flat config, single-process unpadded state dict) of a 3-layer qwen3_moe import (layer 1 dense)."""
    from megatron_lite.checkpoint.hf_folder import load_hf

    qwen3_moe().save_pretrained(str(tmp_path / "hf"))
    bundle = load_hf(str(tmp_path / "hf"))
    return bundle.config, bundle.state_dict


def test_qwen3_moe_sparse_step_becomes_a_layer_pattern():
    """transformers' rule (MoE where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers) as
    a --moe-layer-freq list; a config left without MoE layers is refused."""
    hf = qwen3_moe(mlp_only_layers=(), step=2).config.to_dict()
    assert _qwen3_moe_config(hf)["moe_layer_freq"] == "[0,1,0]"
    assert _qwen3_moe_config({**hf, "decoder_sparse_step": 1})["moe_layer_freq"] == "1"
    with pytest.raises(ConfigError, match="without MoE layers"):
        _qwen3_moe_config({**hf, "mlp_only_layers": [1]})
    with pytest.raises(ConfigError, match="num_experts_per_tok 1 with norm_topk_prob true"):
        _qwen3_moe_config({**hf, "num_experts_per_tok": 1, "norm_topk_prob": True})


def _pretrain(argv):
    return pretrain_gpt.main(argv + ["--mock-data", "--vocab-size", str(VOCAB), "--seq-length", "12",
                                     "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
                                     "--lr", "0", "--eval-iters", "0", "--log-interval", "1"])


def test_printed_flags_load_the_qwen3_checkpoint_through_pretrained_checkpoint(tmp_path, capsys):
    """The printed flags (with --qk-layernorm) load the converted checkpoint as --pretrained-checkpoint
    (lr 0: the saved weights are the converted ones, bit for bit); without --qk-layernorm the load is
    refused in one line naming it, and so is a checkpoint without q/k norms loaded with the flag."""
    qwen3().save_pretrained(str(tmp_path / "hf"))
    out = str(tmp_path / "mega")
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--make-vocab-size-divisible-by", 8) == 0
    flags = _flags(capsys)
    _pretrain(flags + ["--pretrained-checkpoint", out, "--save", str(tmp_path / "ft")])
    got, want = merge_checkpoint(str(tmp_path / "ft"))[0], merge_checkpoint(out)[0]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    capsys.readouterr()
    plain = [f for f in flags if f != "--qk-layernorm"]
    refused_line(capsys, lambda: _pretrain(plain + ["--pretrained-checkpoint", out]), "--qk-layernorm (this run: no --qk-layernorm); load it with --qk-layernorm")
    _pretrain(plain + ["--save", str(tmp_path / "plain")])  # a model without q/k norms, from scratch
    capsys.readouterr()
    refused_line(capsys, lambda: _pretrain(flags + ["--pretrained-checkpoint", str(tmp_path / "plain")]),
                 "no --qk-layernorm (this run: --qk-layernorm); load it without --qk-layernorm")


def test_refusals(tmp_path, capsys):
    model = qwen3()
    model.config.attention_bias = True
    model.config.use_sliding_window, model.config.sliding_window = True, 4
    for change, words in ((dict(attention_bias=False), "use_sliding_window"),
                          (dict(use_sliding_window=False, sliding_window=None), "attention_bias")):
        folder = tmp_path / next(iter(change))
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**model.config.to_dict(), **change})).save_pretrained(
            str(folder))
        capsys.readouterr()
        assert convert("GPT", "--loader", "hf", "--load-dir", folder, "--save-dir", tmp_path / "out") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    # export: the format needs --qk-layernorm, and the older formats cannot hold it
    cfg, sd = _converted(tmp_path, capsys)
    with pytest.raises(ConfigError, match="needs --qk-layernorm"):
        to_qwen3({**cfg, "qk_layernorm": False}, sd)
    with pytest.raises(ConfigError, match="use --hf-style qwen3_moe"):
        to_qwen3({**cfg, "num_experts": 4}, sd)
    with pytest.raises(ConfigError, match="--add-qkv-bias"):
        to_qwen3({**cfg, "add_qkv_bias": True}, sd)
    with pytest.raises(ConfigError, match="a dense model"):
        to_qwen3_moe(cfg, sd)
    for style in ("llama", "qwen2", "gpt2"):
        assert convert("GPT", "--saver", "hf", "--hf-style", style, "--load-dir", tmp_path / "mega",
                       "--save-dir", tmp_path / style) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--qk-layernorm" in err and "use --hf-style qwen3" in err, err


def _converted(tmp_path, capsys):
    qwen3().save_pretrained(str(tmp_path / "hf"))
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "mega",
                   "--make-vocab-size-divisible-by", 8) == 0
    capsys.readouterr()
    sd, cfg = merge_checkpoint(str(tmp_path / "mega"))
    return cfg, {k: v[:VOCAB] if "word_embeddings" in k or "output_layer" in k else v for k, v in sd.items()}


def test_qwen3_import_with_apply_layernorm_1p_stores_the_qk_norms_zero_centred(tmp_path):
    """The hf loader's --apply-layernorm-1p covers the q/k norms too (they are norms of the model):
    stored as weight - 1, the same logits; exported back, the plain weights (1 + w: fp32 rounding, 1e-6)."""
    model = qwen3()
    model.save_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "mega"
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--make-vocab-size-divisible-by", 8, "--apply-layernorm-1p") == 0
    ours, saved = load_gpt_checkpoint(str(out))
    assert saved["apply_layernorm_1p"] and saved["qk_layernorm"]
    want = model.model.layers[0].self_attn.q_norm.weight.detach() - 1
    assert torch.equal(ours.state_dict()["decoder.layers.0.self_attention.q_layernorm.weight"], want)
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], model(TOKENS).logits, rtol=1e-5, atol=1e-5)
    assert convert("GPT", "--saver", "hf", "--load-dir", out, "--save-dir", tmp_path / "again") == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    name = "model.layers.2.self_attn.k_norm.weight"
    torch.testing.assert_close(again.state_dict()[name], model.state_dict()[name], rtol=0, atol=1e-6)


def test_printed_flags_paste_into_a_shell_as_they_are(tmp_path, capsys):
    """The printed line goes through bash unchanged: --moe-layer-freq [1,0,1] (a glob pattern) is quoted,
    so a file named 1 in the current folder does not turn it into --moe-layer-freq 1 (every layer MoE),
    and a --save-dir with a space stays one word."""
    qwen3_moe().save_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "my mega"
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--make-vocab-size-divisible-by", 8) == 0
    line = capsys.readouterr().out.split("load it with: ")[1].split(" (and the tokenizer flags)")[0]
    (tmp_path / "1").write_text("")  # a file the glob [1,0,1] matches
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {line}"], cwd=tmp_path, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert words[:2] == ["--load", str(out)] and words[words.index("--moe-layer-freq") + 1] == "[1,0,1]", words
    config = parse_args(words[2:] + ["--mock-data", "--vocab-size", str(VOCAB)], world_size=1)
    assert config.moe.moe_layer_freq == "[1,0,1]" and config.model.qk_layernorm


def test_qwen3_export_refusals_name_the_qwen3_format(tmp_path, capsys):
    """A --qk-layernorm model the qwen3 format cannot hold (LayerNorm, learned positions) is refused in one
    line naming the qwen3 format, not the llama format with 'use --hf-style gpt2' (which refuses --qk-layernorm)."""
    common = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--swiglu",
              "--disable-bias-linear", "--qk-layernorm", "--max-position-embeddings", "12"]
    for name, extra in (("layernorm", ["--position-embedding-type", "rope", "--normalization", "LayerNorm"]),
                        ("learned", ["--normalization", "RMSNorm"])):
        _pretrain(common + extra + ["--save", str(tmp_path / name)])
        capsys.readouterr()
        assert convert("GPT", "--saver", "hf", "--load-dir", tmp_path / name, "--save-dir", tmp_path / f"{name}-hf") == 2
        err = capsys.readouterr().err
        words = "--normalization LayerNorm" if name == "layernorm" else "--position-embedding-type learned_absolute"
        assert err.count("\n") == 1 and words in err and "qwen3 format" in err and "gpt2" not in err, err
        assert not (tmp_path / f"{name}-hf").exists()


@pytest.mark.parametrize("moe", [False, True])
def test_every_style_refusal_names_the_style_that_exports(moe, tmp_path, capsys):
    """Exporting a Qwen3 (Qwen3-MoE) import with every other --hf-style is refused in one line whose
    'use --hf-style X' (when it gives one) is the style that exports it, never a second refusal (the
    deepseek_v3, mixtral and qwen2 refusals sent --qk-layernorm models to llama or mixtral)."""
    (qwen3_moe() if moe else qwen3()).save_pretrained(str(tmp_path / "hf"))
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "mega",
                   "--make-vocab-size-divisible-by", 8) == 0
    right = "qwen3_moe" if moe else "qwen3"
    for style in ("gpt2", "llama", "mixtral", "deepseek_v3", "qwen2", "qwen3", "qwen3_moe"):
        if style == right:
            continue
        capsys.readouterr()
        assert convert("GPT", "--saver", "hf", "--hf-style", style, "--load-dir", tmp_path / "mega",
                       "--save-dir", tmp_path / style) == 2
        err = capsys.readouterr().err
        hints = err.split("use --hf-style ")[1:]
        assert err.count("\n") == 1 and hints and all(h.split()[0].strip(")") == right for h in hints), (style, err)
    assert convert("GPT", "--saver", "hf", "--hf-style", right, "--load-dir", tmp_path / "mega",
                   "--save-dir", tmp_path / right) == 0


def test_a_damaged_qwen3_folder_names_its_format_and_the_tensor_as_in_the_file(tmp_path, capsys):
    """A Qwen3 folder missing a projection (read through the llama reader) was refused as 'the llama
    weights have no tensor layers.1.self_attn.q_proj.weight': another format, a name not in the file."""
    from safetensors.torch import load_file, save_file

    qwen3().save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    capsys.readouterr()
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the qwen3 weights have no tensor model.layers.1.self_attn.q_proj.weight" in err, err
    assert not (tmp_path / "out").exists()

