"""A Hugging Face folder (``config.json`` + safetensors + tokenizer files) read into a
:class:`~megatron_lite.checkpoint.reshard.ModelBundle` (``load_hf``) and a bundle written as one
(``save_hf``), for every style the converter supports (``tools/checkpoint/convert.py``,
``--loader hf`` / ``--saver hf``: :mod:`.convert`).
"""

from __future__ import annotations

import dataclasses
import os

from ..activations import check_hf_exportable
from ..errors import ConfigError
from ..files import replaced_folder
from ..models.mamba_config import saved_is_hybrid
from .format import CheckpointError
from .hf import from_hf, pick_style, to_hf
from .hf_bert import from_bert, to_bert
from .hf_deepseek import from_deepseek, to_deepseek
from .hf_gptoss import from_gptoss, to_gptoss
from .hf_io import (
    model_files_in,
    parse_size,
    read_json,
    read_safetensors,
    tokenizer_files_in,
    write_json,
    write_safetensors,
)
from .hf_mistral import check_window_exportable, from_mistral, to_mistral
from .hf_mixtral import from_mixtral, to_mixtral
from .hf_qwen2 import from_qwen2, to_qwen2
from .hf_qwen3 import from_qwen3, from_qwen3_moe, to_qwen3, to_qwen3_moe
from .hf_tokenizer import export_tokenizer
from .hf_unused import LAYER, TensorReads, refuse_unused, refuse_vocab_mismatch
from .norm_1p import plain_norms, zero_centred_norms
from .reshard import ModelBundle


def _no_progress(iterable, **_kw):
    return iterable


def load_hf(load_dir: str, make_vocab_size_divisible_by: int = 128, moe_grouped_gemm: bool = False,
            apply_layernorm_1p: bool = False) -> ModelBundle:
    """The bundle of a Hugging Face folder; its tokenizer files are carried along for the saver."""
    path = os.path.join(load_dir, "config.json")
    try:
        config, state_dict = _from_hf_folder(load_dir, read_json(path), moe_grouped_gemm)
    except KeyError as err:  # the readers turn a missing tensor into a ConfigError: this is a config field
        raise CheckpointError(f"{path} has no {err.args[0]!r}, which a {read_json(path).get('model_type')!r} "
                              "config needs; restore it from the original model") from None
    config["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    if apply_layernorm_1p:
        config, state_dict = zero_centred_norms(config, state_dict)
    return ModelBundle(config, state_dict, "release", 0, tokenizer_files_in(load_dir))


def _from_hf_folder(load_dir: str, hf_config: dict, moe_grouped_gemm: bool) -> tuple[dict, dict]:
    """(flat config, state dict) of a Hugging Face folder whose config.json holds ``hf_config``; a
    tensor the import does not use is refused (:mod:`.hf_unused`), never dropped."""
    kind = hf_config.get("model_type")
    if moe_grouped_gemm and kind not in ("mixtral", "deepseek_v3", "qwen3_moe", "gpt_oss"):
        raise ConfigError(f"--moe-grouped-gemm applies to a mixtral, qwen3_moe, gpt_oss or deepseek_v3 model only; "
                          f"{load_dir} holds {kind!r}: drop it")
    tensors = TensorReads(read_safetensors(load_dir))
    refuse_vocab_mismatch(tensors, hf_config, os.path.join(load_dir, "config.json"))
    try:
        out = _convert_hf_tensors(kind, hf_config, tensors, moe_grouped_gemm)
    except RuntimeError as err:  # a reshape or split of a tensor whose shape config.json does not give
        text, last = str(err).strip().splitlines(), tensors.last_read() or ""
        layer = LAYER.search(last)  # the readers convert one layer at a time
        where = f"layer {layer.group(1)} ({last[:layer.end()]}*)" if layer else f"the tensors read up to {last}"
        raise CheckpointError(f"{load_dir}: a tensor of {where} does not have the shape config.json gives "
                              f"({text[0] if text else type(err).__name__}); the folder does not match its config.json") from None
    refuse_unused(tensors, hf_config, load_dir)
    return out


def _convert_hf_tensors(kind: str, hf_config: dict, tensors: TensorReads, moe_grouped_gemm: bool) -> tuple[dict, dict]:
    """The reader of ``model_type`` ``kind``: (flat config, state dict)."""
    moe = {"mixtral": from_mixtral, "gpt_oss": from_gptoss, "deepseek_v3": from_deepseek, "qwen3_moe": from_qwen3_moe}
    if kind in moe:
        return moe[kind](hf_config, tensors, grouped=moe_grouped_gemm)
    dense = {"megatron-bert": from_bert, "qwen2": from_qwen2, "qwen3": from_qwen3, "mistral": from_mistral}
    return dense.get(kind, from_hf)(hf_config, tensors)


def save_hf(bundle: ModelBundle, save_dir: str, style: str = "auto", max_shard_size: str | int = "5GB",
            progress=_no_progress, also=None) -> str:
    """Write ``bundle`` as a Hugging Face folder (config.json with the special-token ids, safetensors,
    generation_config.json, the tokenizer AutoTokenizer reads back to our ids); returns the folder
    and, on a second line, what was written as the tokenizer (or why none). ``progress(iterable, desc=,
    unit=)`` reports the safetensors files as they are written; ``also(folder)`` writes more files (a
    PEFT adapter) staged with the model's."""
    if bundle.config.get("spec"):
        module, name = bundle.config["spec"]
        raise ConfigError(f"the checkpoint was trained with --spec {module} {name} (layers of your own); a Hugging "
                          "Face export writes stock layers and would not compute your model: export is refused")
    if saved_is_hybrid(bundle.config):
        raise ConfigError("the checkpoint holds a hybrid Mamba model (--hybrid-override-pattern ...): a Hugging Face "
                          "export of it is not built; export is refused")
    limit, held = parse_size(max_shard_size), model_files_in(save_dir)  # before the export's warnings
    if held:  # a reader would take a stale model.safetensors over the shards written now (or the reverse)
        raise CheckpointError(f"{save_dir} already holds {', '.join(held[:3])}{' ...' if len(held) > 3 else ''} (a model, "
                              "or the leftover of an interrupted export); choose an empty --save-dir")
    style = pick_style(bundle.config, style)
    check_window_exportable(bundle.config, style)
    check_hf_exportable(bundle.config, style)  # --squared-relu, --quick-geglu, --qk-l2-norm, ...
    bundle = dataclasses.replace(bundle, **dict(zip(("config", "state_dict"),
                                                    plain_norms(bundle.config, bundle.state_dict), strict=True)))
    if style == "mixtral":
        hf_config, tensors = to_mixtral(bundle.config, bundle.state_dict)
    elif style == "gpt_oss":
        hf_config, tensors = to_gptoss(bundle.config, bundle.state_dict)
    elif style == "deepseek_v3":
        hf_config, tensors = to_deepseek(bundle.config, bundle.state_dict)
    elif style == "bert":
        hf_config, tensors = to_bert(bundle.config, bundle.state_dict)
    elif style == "qwen2":
        hf_config, tensors = to_qwen2(bundle.config, bundle.state_dict)
    elif style in ("qwen3", "qwen3_moe"):
        hf_config, tensors = (to_qwen3 if style == "qwen3" else to_qwen3_moe)(bundle.config, bundle.state_dict)
    elif style == "mistral":
        hf_config, tensors = to_mistral(bundle.config, bundle.state_dict)
    else:
        hf_config, tensors = to_hf(bundle.config, bundle.state_dict, style)
    # written into <save_dir>.tmp.<pid> and moved into place once complete: a failed or interrupted
    # export leaves no half-written --save-dir (nor the temporary folder) behind
    with replaced_folder(save_dir, last=("config.json",)) as folder:
        special, note = export_tokenizer(bundle.config, bundle.tokenizer_files, folder)
        hf_config.update(special)
        write_safetensors(tensors, folder, limit, progress)
        if style != "bert" and special and not any(os.path.isfile(os.path.join(d, "generation_config.json"))
                                                   for d in (folder, save_dir)):
            write_json(os.path.join(folder, "generation_config.json"), {**special, "_from_model_config": True})
        write_json(os.path.join(folder, "config.json"), hf_config)  # last: the folder is complete
        if also is not None:
            also(folder)
    return f"{save_dir}\n{note}"
