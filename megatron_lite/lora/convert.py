"""LoRA checkpoints in the converter: read the adapters with their base, merge them, or export them.

A LoRA training checkpoint holds only the adapters plus the record of its base
(:mod:`megatron_lite.checkpoint.frozen`). :func:`read_lora_checkpoint` merges both, at whatever
layouts they were saved, into single-process tensors: the base weights and the adapters. The
converter then either merges the adapters into the base (:func:`merged_bundle`, written at any
layout or as a Hugging Face model) or exports them as a Hugging Face PEFT adapter next to the
exported base (:mod:`megatron_lite.lora.peft_export`).
"""

from __future__ import annotations

import os

from ..checkpoint.dist_read import is_dist_folder, read_common, resolve_folder
from ..checkpoint.format import CheckpointError, find_model_files, read_model_file
from ..checkpoint.merge import merge_checkpoint
from ..precision.fp8 import is_fp8_state_key
from .apply import is_adapter_name
from .config import LoRAConfig
from .merge import merge_lora

LORA_FIELDS = tuple(LoRAConfig.__dataclass_fields__)


def is_lora_config(config: dict) -> bool:
    return bool(config.get("lora_rank"))


def frozen_base_record(path: str) -> dict:
    """The base record a LoRA checkpoint was saved with (either format)."""
    folder = resolve_folder(path)
    if is_dist_folder(folder):
        record = read_common(folder).get("frozen_base")
    else:
        files = find_model_files(path)
        record = read_model_file(files[min(files)]).get("frozen_base")
    if record is None:
        raise CheckpointError(f"{path} has LoRA flags but no record of its base checkpoint")
    return record


def read_lora_checkpoint(path: str, saved: dict, config: dict) -> tuple[dict, dict, dict]:
    """(adapters, single-process weights, base config) of the LoRA checkpoint at ``path`` (whose
    merged tensors ``saved`` and saved ``config`` are given), checked to fit its base. The weights are
    the base's, with the checkpoint's other tensors in place of the base's: the buffers that train
    along with the adapters (the MoE router's expert bias, ``--moe-router-enable-expert-bias``); FP8
    bookkeeping of either is left out."""
    folder = frozen_base_record(path)["folder"]
    if not os.path.isdir(folder):
        raise CheckpointError(f"LoRA checkpoint {path} was trained on the base {folder}, which is gone; restore it")
    base, base_config = merge_checkpoint(folder)
    differ = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                          "num_experts", "swiglu") if base_config.get(k) != config.get(k)]
    if differ:
        raise CheckpointError(f"the base {folder} of LoRA checkpoint {path} differs in {', '.join(differ)}")
    adapters = {k: v for k, v in saved.items() if is_adapter_name(k)}
    # FP8 bookkeeping (amax histories, scales of an --fp8-format run or base) is not a weight: left out
    base = {k: v for k, v in base.items() if not is_fp8_state_key(k)}
    others = {k: v for k, v in saved.items() if k not in adapters and not is_fp8_state_key(k)}
    wrong = [k for k in others if k not in base or tuple(others[k].shape) != tuple(base[k].shape)]
    if wrong:
        raise CheckpointError(f"LoRA checkpoint {path} holds tensors its base {folder} lacks: {', '.join(wrong[:3])}")
    return adapters, {**base, **others}, base_config


def without_lora_flags(config: dict) -> dict:
    """``config`` with LoRA off (what a merged checkpoint records)."""
    defaults = LoRAConfig()
    return {**config, **{name: getattr(defaults, name) for name in LORA_FIELDS}}


def merged_bundle(bundle):
    """A bundle of base weights + adapters (``bundle.adapters``) as one of merged weights."""
    cfg = bundle.config
    merged = merge_lora({**bundle.state_dict, **bundle.adapters}, cfg["lora_alpha"], cfg["lora_rank"])
    return type(bundle)(without_lora_flags(cfg), merged, bundle.iteration, bundle.consumed_samples,
                        bundle.tokenizer_files, None)


def load_lora_gpt(path: str):
    """(single-process GPTModel in eval mode with the adapters of LoRA checkpoint ``path`` on its
    base, saved config): what the LoRA run computed, for tools and tests."""

    from ..checkpoint.merge import model_config_from_saved
    from ..models import GPTModel, TransformerConfig
    from ..moe.config import saved_moe_fields
    from ..parallel.state import ParallelState
    from .apply import apply_lora

    saved, config = merge_checkpoint(path)
    if not is_lora_config(config):
        raise CheckpointError(f"{path} is not a LoRA checkpoint (it was saved without --lora-rank)")
    adapters, base, base_config = read_lora_checkpoint(path, saved, config)
    config = {**config, "padded_vocab_size": base_config["padded_vocab_size"]}  # the base's rows (its TP size)
    moe = saved_moe_fields(config)  # built without FP8
    moe["expert_tensor_parallel_size"] = None  # one process: whole experts
    model_config = TransformerConfig.from_model(model_config_from_saved(config), **moe)
    state = ParallelState(world_size=1, rank=0)
    lora = LoRAConfig(**{name: config[name] for name in LORA_FIELDS})
    model = apply_lora(GPTModel(model_config, state), model_config, lora, state)
    model.load_state_dict({**base, **adapters})
    return model.eval(), config
