"""A config.json may leave out any field of its transformers config class: transformers then reads the
class's default, and so must the HF import (``megatron_lite.checkpoint.hf_defaults``). Each case saves a tiny
model whose config.json writes the field at that default, removes it, and imports the folder: the same
config and tensors as with the field written. The imports used to read their own fallbacks: no window
for Mistral (4096), an aux-loss coefficient 0 (0.001), plain RoPE for gpt-oss (yarn), Qwen2's window
from layer 0 (28)... A size the weights give (key/value heads and head size included, where the config
class has a number of its own for them, and the expert count) is refused with one line naming the field,
in every family: it is not filled with a reference model's."""

import json

import pytest
import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_folder import load_hf

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
CASES = {  # id: (config class, model class, config kwargs, the fields config.json leaves out)
    "llama-max_position_embeddings": ("Llama", TINY, dict(max_position_embeddings=2048), ()),
    "mistral-sliding_window": ("Mistral", TINY, dict(sliding_window=4096), ()),
    "mistral-max_position_embeddings": ("Mistral", TINY, dict(max_position_embeddings=131072), ()),
    "mixtral-router_aux_loss_coef": ("Mixtral", TINY, dict(MOE, router_aux_loss_coef=0.001), ()),
    "mixtral-max_position_embeddings": ("Mixtral", TINY, dict(MOE, max_position_embeddings=131072), ()),
    "qwen2-max_position_embeddings": ("Qwen2", TINY, dict(max_position_embeddings=32768), ()),
    "qwen2-max_window_layers": ("Qwen2", TINY, dict(use_sliding_window=True, sliding_window=8, max_window_layers=28),
                                ("layer_types",)),  # written by transformers 5 (computed from it); not by 4
    "qwen3-max_position_embeddings": ("Qwen3", TINY, dict(head_dim=8, max_position_embeddings=32768), ()),
    "qwen3_moe-router_aux_loss_coef": ("Qwen3Moe", TINY, dict(moe_intermediate_size=8, num_experts=4,
                                                              num_experts_per_tok=2, router_aux_loss_coef=0.001), ()),
    "gpt_oss-sliding_window": ("GptOss", TINY, dict(MOE, head_dim=8, sliding_window=128), ()),
    "gpt_oss-router_aux_loss_coef": ("GptOss", TINY, dict(MOE, head_dim=8, router_aux_loss_coef=0.001), ()),
    "gpt_oss-rope_parameters": ("GptOss", TINY, dict(MOE, head_dim=8), ()),  # the default: yarn, factor 32
}
MODELS = {"Llama": "LlamaForCausalLM", "Mistral": "MistralForCausalLM", "Mixtral": "MixtralForCausalLM",
          "Qwen2": "Qwen2ForCausalLM", "Qwen3": "Qwen3ForCausalLM", "Qwen3Moe": "Qwen3MoeForCausalLM",
          "GptOss": "GptOssForCausalLM", "MegatronBert": "MegatronBertForPreTraining"}


def _save(tmp_path, family: str, kwargs: dict) -> str:
    torch.manual_seed(0)
    config = getattr(transformers, family + "Config")(**kwargs)
    getattr(transformers, MODELS[family])(config).save_pretrained(tmp_path)
    return str(tmp_path)


def _rewrite(folder: str, drop) -> dict:
    with open(f"{folder}/config.json") as f:
        full = json.load(f)
    with open(f"{folder}/config.json", "w") as f:
        json.dump({k: v for k, v in full.items() if k not in drop}, f)
    return full


@pytest.mark.parametrize("case", list(CASES))
def test_a_field_config_json_leaves_out_imports_as_transformers_reads_it(tmp_path, case):
    family, base, fields, also = CASES[case]
    field = case.split("-")[1]
    folder = _save(tmp_path, family, {**base, **fields})
    written = load_hf(folder)
    full = _rewrite(folder, (field, *also))
    assert field in full  # written by transformers, at its default (the field is not in the rewritten file)
    if field in fields:
        assert transformers.AutoConfig.from_pretrained(folder).to_dict()[field] == fields[field]
    left_out = load_hf(folder)
    assert left_out.config == written.config
    assert left_out.state_dict.keys() == written.state_dict.keys()
    assert all(torch.equal(left_out.state_dict[k], v) for k, v in written.state_dict.items())


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
QWEN3_MOE = dict(moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
SIZE_CASES = {  # family: (config kwargs, the sizes config.json must give, also dropped with the first of them)
    "Llama": (TINY, SIZES, {}),
    "Mistral": (dict(TINY, head_dim=8), SIZES + ("num_key_value_heads",), {}),
    "Mixtral": (dict(TINY, **MOE), SIZES + ("num_key_value_heads", "num_local_experts"), {}),
    "Qwen2": (TINY, SIZES + ("num_key_value_heads",), {}),
    "Qwen3": (dict(TINY, head_dim=8), SIZES + ("num_key_value_heads", "head_dim"), {}),
    "Qwen3Moe": (dict(TINY, **QWEN3_MOE), SIZES + ("num_key_value_heads", "moe_intermediate_size", "num_experts"),
                 {"num_experts": ("num_local_experts",)}),  # either name (transformers 5 writes the second)
    "GptOss": (dict(TINY, **MOE, head_dim=8), SIZES + ("num_key_value_heads", "head_dim", "num_local_experts"), {}),
    "MegatronBert": (dict(TINY, num_key_value_heads=None), SIZES + ("max_position_embeddings", "type_vocab_size"), {}),
}


@pytest.mark.parametrize("family", list(SIZE_CASES))
def test_a_size_config_json_leaves_out_is_refused_naming_it(tmp_path, family):
    """The weights give the sizes: a config.json without one is refused naming it, as DeepSeek-V3's
    import does (transformers would read a reference model's size, which the weights need not have).
    Key/value heads, Qwen3's and gpt-oss's head size and Qwen3-MoE's expert count used to be filled
    with transformers' numbers (8, 32, 4 heads; 128, 64; 128 experts); a missing one now fails here."""
    kwargs, sizes, also = SIZE_CASES[family]
    folder = _save(tmp_path, family, {k: v for k, v in kwargs.items() if v is not None})
    full = _rewrite(folder, ())
    load_hf(folder)  # complete: imports
    kind = full["model_type"]
    for field in sizes:
        assert field in full or set(also.get(field, ())) & set(full), field
        _rewrite_from(folder, full, (field, *also.get(field, ())))
        with pytest.raises(CheckpointError, match=f"config.json has no '{field}', which a '{kind}' config needs"):
            load_hf(folder)


def _rewrite_from(folder: str, full: dict, drop) -> None:
    with open(f"{folder}/config.json", "w") as f:
        json.dump({k: v for k, v in full.items() if k not in drop}, f)


DEEPSEEK = dict(TINY, num_key_value_heads=4, moe_intermediate_size=16, kv_lora_rank=8, qk_rope_head_dim=4,
                qk_nope_head_dim=8, v_head_dim=6, n_routed_experts=4, q_lora_rank=16, n_group=2, topk_group=1,
                num_experts_per_tok=2, first_k_dense_replace=1, num_nextn_predict_layers=0)


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek")
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK)).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                                   "moe_intermediate_size", "n_routed_experts", "n_shared_experts"])
def test_a_deepseek_size_config_json_leaves_out_is_refused_naming_it(deepseek_folder, tmp_path, field):
    """DeepSeek-V3 follows the rule of every import: the sizes are not filled with DeepSeek-V3's own
    (hidden 7168, 256 experts, ...), which the weights do not have; they used to be."""
    import shutil

    folder = shutil.copytree(deepseek_folder, tmp_path / "m")
    load_hf(str(folder))  # complete: imports
    _rewrite(str(folder), (field,))
    with pytest.raises(CheckpointError, match=f"config.json has no '{field}', which a 'deepseek_v3' config needs"):
        load_hf(str(folder))


@pytest.mark.parametrize("family", ["Llama", "DeepseekV3"])
@pytest.mark.parametrize("vocab", [60, 70])
def test_a_vocab_size_other_than_the_embedding_rows_is_refused(tmp_path, family, vocab):
    """transformers refuses a folder whose vocab_size is not the embedding's row count (fewer or more:
    a padded vocabulary is padded in both); the import took config.json's and built another model."""
    kwargs = DEEPSEEK if family == "DeepseekV3" else TINY
    torch.manual_seed(0)
    getattr(transformers, family + "ForCausalLM")(getattr(transformers, family + "Config")(**kwargs)).save_pretrained(
        tmp_path)
    full = _rewrite(str(tmp_path), ())
    assert full["vocab_size"] == 64
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**full, "vocab_size": vocab}, f)
    with pytest.raises(CheckpointError, match=f"vocab_size is {vocab} but model.embed_tokens.weight has 64 rows"):
        load_hf(str(tmp_path))
