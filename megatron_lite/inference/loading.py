"""Load a GPT checkpoint for inference at any tensor x pipeline layout, and its tokenizer.

Every rank merges the checkpoint (``torch`` or ``torch_dist``, saved at any TP x PP x EP layout;
:func:`~megatron_lite.checkpoint.merge_checkpoint`) into single-process tensors, builds its own
pipeline chunk on the ``meta`` device (no init cost) and keeps its tensor-parallel slice of each
tensor (:func:`~megatron_lite.parallel.tensor.shard`, the cut the layers themselves use). One
process is the layout TP 1 x PP 1. The vocabulary is padded again for the TP size used here.

Inference settings differ from training in three ways: no dropout (eval mode), no sequence
parallelism (decoding feeds one token at a time), and no MoE capacity limit (no token is dropped).
At TP > 1 a mixture-of-experts layer splits the tokens over the TP ranks itself
(:class:`~megatron_lite.moe.layer.MoELayer`).
"""

from __future__ import annotations

import os

import torch

from ..checkpoint.format import TOKENIZER_FILE_FLAGS, CheckpointError, param_meta
from ..checkpoint.hf_tokenizer import checkpoint_tokenizer
from ..checkpoint.layout import global_name
from ..checkpoint.merge import merge_checkpoint, model_config_from_saved, refuse_lora
from ..checkpoint.reshard import VOCAB_TENSORS, pad_vocab
from ..data.tokenizers import TIKTOKEN_FIELDS, build_tokenizer
from ..errors import ConfigError
from ..fusions.config import fusion_fields
from ..models import GPTModel, TransformerConfig
from ..models.mamba_config import saved_is_hybrid
from ..moe.config import MoEConfig, moe_fields, saved_moe_fields
from ..parallel.pipeline.partition import layer_ranges
from ..parallel.state import ParallelState
from ..parallel.tensor import padded_vocab_size, shard
from ..precision.fp8 import is_fp8_state_key

TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size", *TIKTOKEN_FIELDS)


def context_limit(saved: dict) -> int:
    """The longest sequence the model was trained for: max-position-embeddings with learned
    positions, seq-length with rotary ones."""
    if saved.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        return int(saved.get("max_position_embeddings") or saved["seq_length"])
    return int(saved["seq_length"])


def inference_config(saved: dict, tp: int, params_dtype=torch.float32) -> TransformerConfig:
    """The TransformerConfig of a checkpoint's flat config for inference at tensor size ``tp``."""
    vocab = saved.get("vocab_size") or saved["padded_vocab_size"]
    model = model_config_from_saved({**saved, "vocab_size": vocab, "padded_vocab_size": 0})
    model.padded_vocab_size = padded_vocab_size(vocab, model.make_vocab_size_divisible_by, tp)
    moe = MoEConfig(**saved_moe_fields(saved))  # no FP8 here: no FP8 padding
    moe.moe_expert_capacity_factor, moe.moe_pad_expert_input_to_capacity = None, False  # drop no token
    moe.expert_tensor_parallel_size = None
    fusions = fusion_fields(saved, model.swiglu)  # the fused bias + GeLU is the tanh GeLU: as trained
    fusions.pop("gradient_accumulation_fusion", None)  # training only
    return TransformerConfig.from_model(model, tensor_model_parallel_size=tp, sequence_parallel=False,
                                        moe_split_tokens_over_tp=True, params_dtype=params_dtype,
                                        **moe_fields(moe), **fusions, **numerics_fields(saved))


def numerics_fields(saved: dict) -> dict:
    """The 16-bit numerics flags the checkpoint was trained with (as training's TransformerConfig
    sets them): served in a 16-bit dtype, the model computes as it did in training (no effect in fp32)."""
    scaling = bool(saved.get("apply_query_key_layer_scaling"))
    return dict(attention_softmax_in_fp32=bool(saved.get("attention_softmax_in_fp32")) or scaling,
                apply_query_key_layer_scaling=scaling,
                fp32_residual_connection=bool(saved.get("fp32_residual_connection")))


def check_layout(state, saved: dict) -> None:
    """Inference runs one model replica: the world is exactly TP x PP."""
    if state.world_size != state.tp_size * state.pp_size:
        raise ConfigError(f"inference runs one model over all ranks: world size {state.world_size} must equal "
                          f"--tensor-model-parallel-size {state.tp_size} x --pipeline-model-parallel-size "
                          f"{state.pp_size}")
    if state.pp_size > saved["num_layers"]:
        raise ConfigError(f"--pipeline-model-parallel-size {state.pp_size} is more than the model's "
                          f"{saved['num_layers']} layers")


def _full(merged: dict, name: str, start: int, tied: bool, vocab: int, rows: int) -> torch.Tensor:
    """The full tensor of chunk-local ``name``; vocabulary tensors cut to the real ``vocab`` rows
    and padded with zeros to ``rows``."""
    key = "embedding.word_embeddings.weight" if name == "output_layer.weight" and tied else global_name(name, start)
    if key not in merged:
        raise CheckpointError(f"the checkpoint has no tensor {key}; it does not fit the model its config describes")
    tensor = merged[key]
    return pad_vocab(tensor[:vocab], rows) if name in VOCAB_TENSORS else tensor


def build_chunk(merged: dict, saved: dict, state, params_dtype=torch.float32, device=None) -> GPTModel:
    """This rank's pipeline chunk (eval mode) holding its TP slice of the merged weights ``merged``."""
    config = inference_config(saved, state.tp_size, params_dtype)
    start, end = layer_ranges(config.num_layers, state.pp_size)[state.pp_rank][0]
    with torch.device("meta"):
        model = GPTModel(config, state, pre_process=state.is_first_stage(), post_process=state.is_last_stage(),
                         layer_start=start, layer_end=end)
    meta, tied = param_meta(model), model.tied
    vocab = saved.get("vocab_size") or saved["padded_vocab_size"]
    local = {}
    for name, expected in model.state_dict().items():
        full = _full(merged, name, start, tied, vocab, config.padded_vocab_size)
        part = shard(full, meta[name]["partition_dim"], state.tp_rank, state.tp_size,
                     meta[name]["partition_stride"]) if name in meta else full
        if part.shape != expected.shape:
            raise CheckpointError(f"the checkpoint's {name} has shape {tuple(part.shape)} here, the model needs "
                                  f"{tuple(expected.shape)}; the weights do not fit the saved config")
        local[name] = part.to(expected.dtype)
    model.to_empty(device=device or torch.device("cpu"))
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name not in local:
                buffer.zero_()  # training-only counters (not saved)
    model.load_state_dict(local)
    return model.eval()


def load_model(path: str, state=None, params_dtype=torch.float32, device=None,
               purpose: str = "text generation") -> tuple[GPTModel, dict]:
    """This rank's chunk of the GPT checkpoint at ``path`` (a save folder or an ``iter_*`` folder)
    for the layout of ``state`` (default: one process), and the checkpoint's flat config; ``purpose``:
    what a BERT checkpoint's refusal says needs a GPT one."""
    state = state if state is not None else ParallelState(world_size=1, rank=0)
    merged, saved = merge_checkpoint(path)
    if "bert_no_binary_head" in saved:
        raise CheckpointError(f"{path} holds a BERT checkpoint; {purpose} needs a GPT checkpoint")
    refuse_lora(path, saved)
    if saved_is_hybrid(saved):
        raise CheckpointError(f"{path} holds a hybrid Mamba model: {purpose} of it is not built (no Mamba state "
                              "cache); evaluate it with pretrain_gpt.py --skip-train")
    check_layout(state, saved)
    merged = {k: v for k, v in merged.items() if not is_fp8_state_key(k)}
    try:
        return build_chunk(merged, saved, state, params_dtype, device), saved
    except ValueError as err:
        if isinstance(err, (CheckpointError, ConfigError)):
            raise
        raise CheckpointError(f"{path}: the saved model config is not usable here ({err})") from None


def _check_saved_files(pick: dict, overrides: dict) -> None:
    """ConfigError naming a tokenizer file the checkpoint names that is not there: checkpoints record
    absolute paths (format.saved_config), older ones the run's flag as given, relative to its folder."""
    for key in TOKENIZER_FILE_FLAGS:
        if overrides.get(key) is None and isinstance(pick[key], str) and not os.path.exists(pick[key]):
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"{pick[key]}: the tokenizer file the checkpoint names (its run's {flag}) is not found "
                              f"from {os.getcwd()}; a relative path is relative to the folder that run started in: "
                              f"run from there, or pass {flag} PATH (lm-eval: {key}=PATH in --model_args)")


def load_tokenizer(saved: dict, path: str | None = None, **overrides):
    """The tokenizer the checkpoint was trained with; each of ``overrides`` (tokenizer_type,
    vocab_file, merge_file, tokenizer_model, vocab_size: NullTokenizer's ``--vocab-size``, the
    ``tiktoken_*`` fields) that is not None replaces the saved one. A checkpoint converted from Hugging Face names no tokenizer:
    the files convert.py kept in its ``tokenizer`` folder (under ``path``, the checkpoint) are used."""
    if overrides.get("tokenizer_type") is None and saved.get("tokenizer_type") is None and path is not None:
        saved = {**saved, **(checkpoint_tokenizer(path) or {})}
    pick = {k: overrides.get(k) if overrides.get(k) is not None else saved.get(k) for k in TOKENIZER_FIELDS}
    if pick["tokenizer_type"] == "NullTokenizer" and overrides.get("vocab_size") is None and saved.get("vocab_size"):
        pick["vocab_size"] = saved["vocab_size"] - 1  # the model's vocabulary is --vocab-size + 1 (the eod)
    if pick["tokenizer_type"] is None:
        raise ConfigError("the checkpoint names no tokenizer and holds no tokenizer folder; pass --tokenizer-type "
                          "and its files")
    if overrides.get("tokenizer_type") is None:
        _check_saved_files(pick, overrides)
    tokenizer = build_tokenizer(pick.pop("tokenizer_type"), **pick)
    padded = saved.get("padded_vocab_size") or 0
    if tokenizer.vocab_size > padded:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's vocabulary only "
                          f"{padded}; use the tokenizer the model was trained with")
    return tokenizer
