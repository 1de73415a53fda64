"""Hugging Face DeepSeek-V3 import and export (tools/checkpoint/convert.py, ``deepseek_v3`` style)
against transformers' ``DeepseekV3ForCausalLM`` on tiny random models, fp32, eval mode.

Imported models (random transformers models, every weight perturbed, a random correction bias,
MTP tensors of DeepSeek's layout added to the folder):

* ``v3``: q compression, YaRN (mscale = mscale_all_dim = 1), the first layer dense, MoE with 4
  experts top-2 in 2 groups / top-1 group, a shared expert, scaling 2.5, untied, MTP 1 (MoE);
* ``lite``: no q compression, plain RoPE in rotate-half order (``rope_interleave`` false: the
  importer interleaves the rotary rows), tied, every layer MoE top-1 unnormalised, 2 shared
  experts, MTP 2.

Logits agree within 1e-5, with sequential or grouped-GEMM experts; the imported MTP layers'
per-token losses equal transformers' own MTP modules (``MtpLayer``, which ``DeepseekV3ForCausalLM``
does not run) fed the same inputs. A model of ours (YaRN with an mscale transformers derives
differently: an ``attention_factor`` is written; no expert bias: zeros written; grouped GEMM)
exports to the same logits. Both round trips are bit-exact, MTP included. Imported YaRN settings
give transformers' frequencies, table scale and softmax scale (also where transformers ignores
``mscale`` or an ``attention_factor`` overrides it). Each refusal (import: a changed config.json or
weights; export: a changed saved config) is one line naming the option, exit 2, nothing written.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.checkpoint import load_gpt_checkpoint, merge_checkpoint
from megatron_lite.errors import ConfigError
from megatron_lite.models import TransformerConfig
from megatron_lite.models.mtp import mtp_targets
from tests.convert_helpers import assert_same_weights, convert, save_ours

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")

VOCAB, LAYERS = 100, 2
TOKENS = torch.tensor([[5, 17, 42, 8, 61, 3, 99, 0, 12, 77, 31, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
LABELS = TOKENS.roll(-1, dims=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0}
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=6, n_routed_experts=4, max_position_embeddings=64)
VARIANTS = {
    "v3": (dict(q_lora_rank=16, rope_parameters=YARN, n_shared_experts=1, routed_scaling_factor=2.5, n_group=2,
                topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, tie_word_embeddings=False), 1),
    "lite": (dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rope_interleave=False,
                  n_shared_experts=2, routed_scaling_factor=1.0, n_group=1, topk_group=1, num_experts_per_tok=1,
                  norm_topk_prob=False, first_k_dense_replace=0, tie_word_embeddings=True), 2),
}


def _mtp_layer(config, k):
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    return MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, LAYERS + k).eval()


def _perturb(module, seed, fresh=False):
    """Add noise to every parameter (``fresh``: replace it, norms around 1) and draw the correction bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.3
            p.copy_(noise + ("norm" in name) if fresh else p + noise)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def _write_hf(variant, folder):
    """A random transformers model saved in ``folder`` plus its MTP layers in DeepSeek's layout
    (``model.layers.{L + k}.*``); returns (model, MTP layers)."""
    fields, depth = VARIANTS[variant]
    config = transformers.DeepseekV3Config(**BASE, **fields, num_nextn_predict_layers=depth)
    torch.manual_seed(4)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    _perturb(model, 5)
    model.save_pretrained(folder)
    tensors = st.load_file(os.path.join(folder, "model.safetensors"))
    layers = []
    for k in range(depth):
        layer = _mtp_layer(config, k)
        _perturb(layer, 6 + k, fresh=True)  # its experts are allocated, not initialised
        prefix = f"model.layers.{LAYERS + k}."
        for name, t in layer.state_dict().items():
            name = prefix + name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
            if variant == "v3" and name.endswith("experts.gate_up_proj"):  # the hub's per-expert names
                for j in range(t.shape[0]):
                    gate, up = t[j].chunk(2)
                    tensors[name.replace("gate_up_proj", f"{j}.gate_proj.weight")] = gate.clone()
                    tensors[name.replace("gate_up_proj", f"{j}.up_proj.weight")] = up.clone()
            elif variant == "v3" and name.endswith("experts.down_proj"):
                for j in range(t.shape[0]):
                    tensors[name.replace("down_proj", f"{j}.down_proj.weight")] = t[j].clone()
            else:  # lite: transformers' fused in-memory expert layout, which the importer also reads
                tensors[name] = t.clone()
        tensors[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
        layers.append(layer)
    st.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return model, layers


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_deepseek")
    return {v: (str(root / v), *_write_hf(v, str(root / v))) for v in VARIANTS}


def _import(folder, out, *extra):
    assert convert("GPT", "--loader", "hf", "--load-dir", folder, "--save-dir", out, "--make-vocab-size-divisible-by",
                   8, *extra) == 0
    return load_gpt_checkpoint(str(out))


def test_a_config_json_leaving_fields_out_imports_transformers_defaults():
    """config.json may leave out any DeepseekV3Config field: transformers then reads its default
    (DeepSeek-V3's 8 groups / top-4 groups, top-8, scaling 2.5, the first 3 layers dense, ...), and so
    does the import: the same model as from the config with every field written."""
    from megatron_lite.checkpoint.hf_deepseek import MOE_SIZES, SIZES, from_deepseek

    config = transformers.DeepseekV3Config(**dict(BASE, num_hidden_layers=4, n_routed_experts=16, q_lora_rank=16,
                                                  num_nextn_predict_layers=0))
    weights = transformers.DeepseekV3ForCausalLM(config).state_dict()
    full = config.to_dict()
    written = {k: v for k, v in full.items() if k not in transformers.DeepseekV3Config().to_dict()
               or v != transformers.DeepseekV3Config().to_dict()[k] or k in SIZES + MOE_SIZES}  # sizes: never filled
    assert not {"n_group", "topk_group", "num_experts_per_tok", "routed_scaling_factor", "first_k_dense_replace"} & set(written)
    assert from_deepseek(written, weights)[0] == from_deepseek(full, weights)[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("grouped", [False, True])
def test_import_gives_the_logits_of_transformers(hf_models, tmp_path, variant, grouped):
    folder, model, _ = hf_models[variant]
    ours, saved = _import(folder, tmp_path / "mega", *(["--moe-grouped-gemm"] if grouped else []))
    assert saved["mtp_num_layers"] == VARIANTS[variant][1] and saved["moe_grouped_gemm"] == grouped
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], model(TOKENS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_imported_mtp_equals_transformers_mtp_modules(hf_models, tmp_path, variant):
    """Depth k: transformers' ``MtpLayer`` on the embedding of the tokens k ahead and the previous
    depth's output (the main model's normed output for k = 1), at the same positions; per-token
    cross-entropy of ``lm_head`` against the labels k ahead."""
    folder, model, layers = hf_models[variant]
    ours, _ = _import(folder, tmp_path / "mega")
    depth = len(layers)
    targets = mtp_targets(TOKENS, LABELS, torch.ones_like(TOKENS, dtype=torch.float), depth)
    with torch.no_grad():
        losses = ours(TOKENS, labels=LABELS, mtp_tokens=targets["mtp_tokens"], mtp_labels=targets["mtp_labels"])
        positions = torch.arange(TOKENS.shape[1]).unsqueeze(0)
        hidden = model.model(TOKENS).last_hidden_state
        rotary = model.model.rotary_emb(hidden, positions)
        for k, layer in enumerate(layers):
            embedded = model.model.embed_tokens(targets["mtp_tokens"][k])
            hidden = layer(embedded, hidden, rotary, None, positions, None)
            want = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), targets["mtp_labels"][k].flatten(),
                                   reduction="none").view_as(TOKENS)
            torch.testing.assert_close(losses[1 + k], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope", [
    {**YARN, "mscale": 0.7, "mscale_all_dim": 0.0},  # transformers ignores mscale without mscale_all_dim
    {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707, "factor": 40.0},  # the hub's DeepSeek-V3 values
    {**YARN, "attention_factor": 1.3, "mscale_all_dim": 0.5},
], ids=["mscale-ignored", "hub", "attention-factor"])
def test_imported_yarn_is_transformers_yarn(hf_models, rope):
    """Our imported --rotary-scaling-factor / --mscale / --mscale-all-dim give transformers' YaRN
    frequencies, table scale and softmax scale."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_lite.checkpoint.hf_deepseek import from_deepseek
    from megatron_lite.models.yarn import get_mscale, mla_softmax_scale, yarn_inv_freq

    folder, model, _ = hf_models["v3"]
    hf = {**json.loads(open(os.path.join(folder, "config.json")).read()), "rope_parameters": rope}
    cfg = from_deepseek(hf, st.load_file(os.path.join(folder, "model.safetensors")))[0]
    config = transformers.DeepseekV3Config(**{**hf, "rope_parameters": {k: v for k, v in rope.items() if v is not None}})
    inv_freq, table_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    f = cfg["rotary_scaling_factor"]
    ours = yarn_inv_freq(cfg["qk_pos_emb_head_dim"], cfg["rotary_base"], f, cfg["original_max_position_embeddings"],
                         cfg["beta_fast"], cfg["beta_slow"])
    torch.testing.assert_close(ours, inv_freq.float(), rtol=1e-6, atol=0)
    assert get_mscale(f, cfg["mscale"]) / get_mscale(f, cfg["mscale_all_dim"]) == pytest.approx(table_scale, rel=1e-12)
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, 0)
    ns = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, **{
        k: cfg[k] for k in ("qk_head_dim", "qk_pos_emb_head_dim", "rotary_scaling_factor", "mscale_all_dim")})
    assert mla_softmax_scale(ns) == pytest.approx(attention.scaling, rel=1e-12)


def test_hf_ours_hf_round_trip_is_bit_exact(hf_models, tmp_path):
    """Every tensor of the folder, the MTP layers and their embedding / head copies included."""
    folder = hf_models["v3"][0]
    convert("GPT", "--loader", "hf", "--load-dir", folder, "--save-dir", tmp_path / "mega",
            "--target-expert-parallel-size", 2, "--target-pipeline-parallel-size", 2, "--moe-grouped-gemm")
    assert convert("GPT", "--saver", "hf", "--load-dir", tmp_path / "mega", "--save-dir", tmp_path / "hf") == 0
    want = st.load_file(os.path.join(folder, "model.safetensors"))
    got = st.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(want) and any(k.startswith(f"model.layers.{LAYERS}.shared_head") for k in got)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


# ---------------------------------------------------------------------------------------------
# Export of a model of ours.

OURS = dict(num_layers=3, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, seq_length=16,
            max_position_embeddings=16, vocab_size=VOCAB, make_vocab_size_divisible_by=8, attention_dropout=0.0,
            hidden_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
            disable_bias_linear=True, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
            qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=8.0,
            mscale=0.5, mscale_all_dim=0.0, original_max_position_embeddings=8, rotary_base=500, mtp_num_layers=1)
OURS_MOE = dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_layer_freq="([0]+[1]*2)",
                moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid", moe_router_num_groups=2,
                moe_router_group_topk=1, moe_grouped_gemm=True)


@pytest.fixture(scope="module")
def ours_checkpoint(tmp_path_factory):
    return save_ours(tmp_path_factory.mktemp("ours"), OURS, OURS_MOE)


def test_export_gives_the_same_logits_in_transformers(ours_checkpoint, tmp_path):
    out = tmp_path / "hf"
    assert convert("GPT", "--saver", "hf", "--load-dir", ours_checkpoint, "--save-dir", out) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["rope_parameters"]["attention_factor"] == pytest.approx(0.05 * torch.log(torch.tensor(8.0)) + 1)
    assert written["n_shared_experts"] == 2 and written["first_k_dense_replace"] == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    ours, _ = load_gpt_checkpoint(ours_checkpoint)
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours(TOKENS)[..., :VOCAB], rtol=1e-5, atol=1e-5)


def test_ours_hf_ours_round_trip_is_bit_exact(ours_checkpoint, tmp_path):
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert convert("GPT", "--saver", "hf", "--load-dir", ours_checkpoint, "--save-dir", hf) == 0
    assert convert("GPT", "--loader", "hf", "--load-dir", hf, "--save-dir", back, "--moe-grouped-gemm",
                   "--make-vocab-size-divisible-by", 8, "--target-tensor-parallel-size", 2,
                   "--target-expert-parallel-size", 2) == 0
    got, cfg = merge_checkpoint(str(back))
    want = merge_checkpoint(ours_checkpoint)[0]
    bias = [k for k in got if k.endswith("expert_bias")]  # the export writes zeros for a router without one
    assert bias and all(not got.pop(k).any() for k in bias)
    assert_same_weights(got, want, VOCAB)
    for key in ("rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
                "rotary_base", "moe_layer_freq"):
        assert str(cfg[key]) == str({**OURS, **OURS_MOE}[key]) or key == "moe_layer_freq", key


def test_training_only_options_without_a_field_are_named_in_a_warning(ours_checkpoint, caplog):
    """--hidden-dropout, --moe-input-jitter-eps and --moe-z-loss-coeff act in training only and have no
    DeepSeek-V3 field: one warning names them; --attention-dropout is attention_dropout."""
    from megatron_lite.checkpoint.hf_deepseek import to_deepseek

    sd, cfg = merge_checkpoint(ours_checkpoint)
    cfg.update(hidden_dropout=0.1, attention_dropout=0.05, moe_input_jitter_eps=0.01, moe_z_loss_coeff=0.001)
    with caplog.at_level("WARNING"):
        hf, _ = to_deepseek(cfg, sd)
    assert hf["attention_dropout"] == 0.05 and "jitter" not in json.dumps(hf)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "--hidden-dropout 0.1, --moe-input-jitter-eps 0.01, --moe-z-loss-coeff 0.001"]
    assert "deepseek_v3 format" in caplog.records[0].getMessage()


# ---------------------------------------------------------------------------------------------
# Refusals: one line naming the option, exit 2, nothing written.


def _refused(capsys, out, *argv, words):
    capsys.readouterr()
    assert convert("GPT", *argv, "--save-dir", out) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not os.path.exists(out)


def _changed_folder(src, dst, config=(), tensors=None):
    """A copy of the Hugging Face folder ``src`` with config.json entries replaced (None: removed) and
    ``tensors(dict)`` applied to its weights."""
    os.makedirs(dst)
    hf = json.loads(open(os.path.join(src, "config.json")).read())
    hf.update(dict(config))
    hf = {k: v for k, v in hf.items() if v is not None}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)
    weights = st.load_file(os.path.join(src, "model.safetensors"))
    if tensors:
        tensors(weights)
    st.save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _other_embedding_copy(t):
    t[f"model.layers.{LAYERS}.embed_tokens.weight"] = t[f"model.layers.{LAYERS}.embed_tokens.weight"] + 1


IMPORT_REFUSALS = [
    (dict(scoring_func="softmax"), None, "scoring_func 'softmax' cannot be expressed"),
    (dict(topk_method="greedy"), None, "topk_method 'greedy' cannot be expressed"),
    (dict(quantization_config={"quant_method": "fp8"}), None, "quantization_config"),
    (dict(rms_norm_eps=1e-5), None, "rms_norm_eps 1e-05 cannot be expressed"),
    (dict(norm_topk_prob=False), None, "norm_topk_prob False with num_experts_per_tok 2 cannot be expressed"),
    (dict(n_group=4, topk_group=2, num_experts_per_tok=2), None, "num_experts_per_tok 2 / topk_group 2 != 2"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), None,
     "rope_type 'linear' cannot be expressed"),
    (dict(rope_parameters={**YARN, "factor": None}), None, "a yarn rope_parameters without factor"),
    (dict(rope_parameters={**YARN, "factor": 1.0, "attention_factor": 1.5}), None,
     "which --mscale / --mscale-all-dim cannot express with factor 1.0"),
    (dict(first_k_dense_replace=2), None, "first_k_dense_replace 2 makes the multi-token prediction layers differ"),
    (dict(moe_layer_freq=2), None, "moe_layer_freq 2 cannot be expressed"),
    (dict(attention_bias=True), None, "attention_bias true cannot be expressed"),
    (dict(hidden_act="gelu"), None, "hidden_act 'gelu' cannot be expressed"),
    ((), _other_embedding_copy, f"model.layers.{LAYERS}.embed_tokens.weight differs from model.embed_tokens.weight"),
    ((), lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
     "have no tensor layers.1.mlp.experts.3.up_proj.weight"),
]


def test_a_folder_counting_mtp_layers_it_does_not_hold_imports_without_mtp(hf_models, tmp_path, caplog):
    """docs/deepseek-v3.md: what save_pretrained writes for a model built in transformers (its config counts
    MTP layers, its weights hold none) imports without MTP, with a warning, and gives transformers' logits."""
    folder, model, _ = hf_models["v3"]

    def drop_mtp(t):
        for name in [n for n in t if n.startswith(f"model.layers.{LAYERS}.")]:
            del t[name]

    bare = _changed_folder(folder, str(tmp_path / "bare"), tensors=drop_mtp)
    with caplog.at_level("WARNING"):
        ours, saved = _import(bare, tmp_path / "mega")
    assert not saved["mtp_num_layers"]
    assert any("hold no multi-token prediction layer: importing the model without MTP" in r.getMessage()
               for r in caplog.records)
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], model(TOKENS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config, tensors, words", IMPORT_REFUSALS, ids=[w[:30] for _, _, w in IMPORT_REFUSALS])
def test_import_refuses_what_our_model_cannot_express(hf_models, tmp_path, capsys, config, tensors, words):
    folder = _changed_folder(hf_models["v3"][0], str(tmp_path / "hf"), config, tensors)
    _refused(capsys, str(tmp_path / "out"), "--loader", "hf", "--load-dir", folder, words=words)


EXPORT_REFUSALS = [
    (dict(multi_latent_attention=False), "without --multi-latent-attention cannot be expressed in the deepseek_v3 "
     "format; no format holds its --mtp-num-layers"),
    (dict(normalization="LayerNorm"), "--normalization LayerNorm cannot be expressed in the deepseek_v3 format"),
    (dict(swiglu=False), "no --swiglu"),
    (dict(qk_layernorm=False), "no --qk-layernorm"),
    (dict(disable_bias_linear=False), "biases (no --disable-bias-linear) cannot be expressed in the deepseek_v3 format"),
    (dict(norm_epsilon=1e-5), "--norm-epsilon 1e-05 cannot be expressed in the deepseek_v3 format (transformers' "
     "latent norms always use 1e-6"),
    (dict(moe_layer_freq="([0]+[1]+[0])"), "--moe-layer-freq '([0]+[1]+[0])' cannot be expressed"),
    (dict(moe_router_score_function="softmax"), "--moe-router-score-function softmax cannot be expressed"),
    (dict(moe_shared_expert_gate=True), "--moe-shared-expert-gate cannot be expressed"),
    (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor (capacity dropping) cannot be expressed"),
    (dict(moe_router_load_balancing_type=["sinkhorn"]), "sinkhorn cannot be expressed"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=2), "--moe-router-topk 2 / --moe-router-group-topk 2 != 2 cannot be expressed"),
    (dict(moe_shared_expert_intermediate_size=24), "--moe-shared-expert-intermediate-size 24 cannot be expressed"),
    (dict(rope_type="rope", rotary_scaling_factor=4.0, mscale_all_dim=1.0), "--rope-type rope with "
     "--rotary-scaling-factor and --mscale-all-dim"),
]


@pytest.mark.parametrize("change, words", EXPORT_REFUSALS, ids=[w[:30] for _, w in EXPORT_REFUSALS])
def test_export_refuses_what_the_format_cannot_express(ours_checkpoint, change, words):
    from megatron_lite.checkpoint.hf_deepseek import check_deepseek

    cfg = {**merge_checkpoint(ours_checkpoint)[1], **change}
    with pytest.raises(ConfigError) as err:
        check_deepseek(cfg)
    assert words in str(err.value) and "\n" not in str(err.value), err.value


def test_export_refusals_through_the_command_line(ours_checkpoint, tmp_path, capsys):
    for i, (style, words) in enumerate([("llama", "--multi-latent-attention cannot be expressed in the llama format; "
                                                  "use --hf-style deepseek_v3"),
                                        ("mixtral", "in the mixtral format; use --hf-style deepseek_v3")]):
        _refused(capsys, str(tmp_path / f"out{i}"), "--saver", "hf", "--hf-style", style, "--load-dir",
                 ours_checkpoint, words=words)
