"""``convert.py --loader hf`` refuses a tensor it would drop (exit 2, one line naming a few and the
likely cause): a config.json counting fewer layers or experts than the weights hold used to convert
into a truncated model with exit 0. What transformers saves beside the weights (rotary / position id
buffers, GPT-2's mask buffers, copies of tied weights) still converts."""

import json

import pytest
import torch

from tests.tools import load_tool

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")

SMALL = dict(vocab_size=64, max_position_embeddings=32)
LLAMA = dict(SMALL, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
MODELS = {  # name: (model type flag, transformers class, config)
    "gpt2": ("GPT", "GPT2LMHeadModel", transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2,
                                                                n_head=2)),
    "llama": ("GPT", "LlamaForCausalLM", transformers.LlamaConfig(**LLAMA)),
    "llama_tied": ("GPT", "LlamaForCausalLM", transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)),
    "mixtral": ("GPT", "MixtralForCausalLM", transformers.MixtralConfig(**LLAMA, num_local_experts=4)),
    "bert": ("BERT", "MegatronBertForPreTraining", transformers.MegatronBertConfig(
        **SMALL, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)),
    "deepseek": ("GPT", "DeepseekV3ForCausalLM", transformers.DeepseekV3Config(
        **SMALL, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_shared_experts=1)),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family saved by the installed transformers (what it writes is what must convert)."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    for name, (_, cls, cfg) in MODELS.items():
        getattr(transformers, cls)(cfg).save_pretrained(str(root / name))
    return root


def _copy(saved, name, tmp_path, config=None, tensors=None):
    """A copy of a saved folder with config.json fields changed and tensors added or replaced."""
    folder = tmp_path / name
    folder.mkdir()
    cfg = json.loads((saved / name / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    weights = st.load_file(str(saved / name / "model.safetensors"))
    for key, make in (tensors or {}).items():
        weights[key] = make(weights).clone()
    st.save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _convert(folder, model_type, tmp_path, capsys):
    capsys.readouterr()
    code = load_tool("checkpoint/convert").main(["--model-type", model_type, "--loader", "hf", "--load-dir",
                                                 str(folder), "--save-dir", str(tmp_path / "out")])
    return code, capsys.readouterr().err.strip().splitlines()


FEWER = {  # name: (config.json change, words of the refusal)
    "gpt2": ({"n_layer": 1}, ["transformer.h.1.", "n_layer says 1 layers but the weights hold 2"]),
    "llama": ({"num_hidden_layers": 1}, ["model.layers.1.", "num_hidden_layers says 1 layers but the weights hold 2"]),
    "mixtral": ({"num_local_experts": 2}, ["experts.2.", "num_local_experts says 2 experts but the weights hold 4"]),
    "bert": ({"num_hidden_layers": 1}, ["bert.encoder.layer.1.", "num_hidden_layers says 1 layers"]),
    "deepseek": ({"num_hidden_layers": 2, "num_nextn_predict_layers": 0}, ["model.layers.2.", "num_hidden_layers says 2 layers but the weights hold 3"]),
}


@pytest.mark.parametrize("name", list(FEWER))
def test_a_config_describing_less_than_the_weights_is_refused(saved, tmp_path, capsys, name):
    change, words = FEWER[name]
    folder = _copy(saved, name, tmp_path, config=change)
    code, lines = _convert(folder, MODELS[name][0], tmp_path, capsys)
    assert code == 2 and len(lines) == 1, lines
    for word in [str(folder), "would be dropped by the import", *words]:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def _copy_of(name):
    return lambda w: w[name]


HARMLESS = {  # what transformers (this or an older version) saves beside the weights
    "gpt2": {"transformer.h.0.attn.bias": lambda w: torch.tril(torch.ones(1, 1, 32, 32, dtype=torch.bool)),
             "transformer.h.1.attn.masked_bias": lambda w: torch.tensor(-1e4),
             "lm_head.weight": _copy_of("transformer.wte.weight")},
    "llama": {"model.layers.0.self_attn.rotary_emb.inv_freq": lambda w: torch.ones(4)},
    "llama_tied": {"lm_head.weight": _copy_of("model.embed_tokens.weight")},
    "bert": {"bert.embeddings.position_ids": lambda w: torch.arange(32)[None],
             "cls.predictions.decoder.weight": _copy_of("bert.embeddings.word_embeddings.weight"),
             "cls.predictions.decoder.bias": _copy_of("cls.predictions.bias")},
}


@pytest.mark.parametrize("name", list(MODELS))
def test_what_transformers_saves_converts(saved, tmp_path, capsys, name):
    folder = _copy(saved, name, tmp_path, tensors=HARMLESS.get(name))
    code, lines = _convert(folder, MODELS[name][0], tmp_path, capsys)
    assert code == 0, lines


@pytest.mark.parametrize("name, config, tensors, words", [
    ("llama_tied", {}, {"lm_head.weight": lambda w: torch.zeros_like(w["model.embed_tokens.weight"])},
     ["lm_head.weight", "tie_word_embeddings is true but the output layer differs"]),
    ("llama", {}, {"model.layers.0.self_attn.q_proj.bias": lambda w: torch.ones(16)},
     ["model.layers.0.self_attn.q_proj.bias", "config.json does not describe"]),
])
def test_other_tensors_the_import_would_drop_are_refused(saved, tmp_path, capsys, name, config, tensors, words):
    folder = _copy(saved, name, tmp_path, config=config, tensors=tensors)
    code, lines = _convert(folder, MODELS[name][0], tmp_path, capsys)
    assert code == 2 and len(lines) == 1, lines
    for word in words:
        assert word in lines[0], lines[0]
