"""Checkpoint conversion: loader and saver plugins behind ``tools/checkpoint/convert.py``.

A loader reads a checkpoint into a layout-free :class:`~megatron_lite.checkpoint.reshard.ModelBundle`;
a saver writes a bundle. Each plugin is a :class:`Plugin`: ``add_arguments(parser)`` for its own
options and ``run`` (``load(args, progress) -> ModelBundle`` or ``save(bundle, args, progress) -> str``).

==============  ===============================================================================
``megatron``    megatron_lite training checkpoints (``mp_rank_*`` folders), any TP x PP (x VPP)
                layout, GPT or BERT, with experts (``mp_rank_*_{ep}``, any EP size, or a folded
                expert grid's ``mp_rank_*_{ep}_{etp}``); the saver writes ``--target-*`` sizes
                (default: the source's)
``hf``          Hugging Face folders (``config.json`` + safetensors): gpt2, llama, qwen2, qwen3,
                qwen3_moe, mixtral, gpt_oss, megatron-bert and deepseek_v3 styles
==============  ===============================================================================
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
from collections.abc import Callable
from typing import NamedTuple

from ..config import ModelConfig, ParallelConfig
from ..errors import ConfigError, OneLineParser
from ..fusions.config import tanh_gelu
from ..moe.config import MoEConfig
from .compat import SPLIT_FLAGS
from .hf import STYLES, pick_style
from .hf_folder import load_hf, save_hf
from .hf_io import TOKENIZER_DIR, copy_tokenizer_files
from .hf_tokenizer import add_bert_vocab_txt, tokenizer_flags, tokenizer_in_folder
from .layout import check_expert_size, check_model_type, num_experts
from .reshard import ModelBundle, TargetLayout, load_megatron, save_megatron, target_config


class Plugin(NamedTuple):
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable


def _no_progress(iterable, **_kw):
    return iterable


# ---------------------------------------------------------------------------------------------
# megatron


def _megatron_loader_args(parser) -> None:
    del parser  # the source layout is read from the checkpoint itself


def _load_megatron(args, progress=_no_progress) -> ModelBundle:
    return load_megatron(args.load_dir, progress)


def _megatron_saver_args(parser) -> None:
    group = parser.add_argument_group("megatron saver")
    group.add_argument("--target-tensor-parallel-size", type=int, default=None,
                       help="Tensor-parallel size to write (default: the source's, 1 for Hugging Face).")
    group.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                       help="Pipeline-parallel size to write (default: the source's, 1 for Hugging Face).")
    group.add_argument("--target-expert-parallel-size", type=int, default=None,
                       help="Expert-parallel size to write (default: the source's, 1 for Hugging Face); "
                            "must divide --num-experts.")
    group.add_argument("--target-expert-tensor-parallel-size", type=int, default=None,
                       help="Expert-tensor-parallel size to write (default: the source's; experts split like the dense "
                            "layers stay so at another TP); one neither 1 nor the target TP folds the experts onto their "
                            "own grid (mp_rank_TT_PPP_EEE_XX files).")
    group.add_argument("--target-data-parallel-size", type=int, default=None,
                       help="Data-parallel size of the run that will load it, needed only when "
                            "--target-expert-parallel-size does not divide it (EP across context-parallel or TP ranks): "
                            "the experts are then written folded (default: a size EP divides).")
    group.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Interleaved pipeline: layers per virtual stage (as --num-layers-per-virtual-pipeline-stage).")
    group.add_argument("--target-decoder-first-pipeline-num-layers", type=int, default=None,
                       help="Layers on the first pipeline stage (as --decoder-first-pipeline-num-layers).")
    group.add_argument("--target-decoder-last-pipeline-num-layers", type=int, default=None,
                       help="Layers on the last pipeline stage (as --decoder-last-pipeline-num-layers).")
    group.add_argument("--target-pipeline-model-parallel-layout", default=None,
                       help="What each (virtual) pipeline stage holds (as --pipeline-model-parallel-layout).")
    group.add_argument("--target-account-for-embedding-in-pipeline-split", action="store_true", default=None,
                       help="The even split counts the embedding as a layer (as --account-for-embedding-in-pipeline-split).")
    group.add_argument("--target-account-for-loss-in-pipeline-split", action="store_true", default=None,
                       help="The even split counts the loss as a layer (as --account-for-loss-in-pipeline-split).")


def target_layout(bundle: ModelBundle, args) -> TargetLayout:
    """The ``--target-*`` options, defaulting to the source's layout (a PP change resets the stage split)."""
    src = bundle.config
    for flag in ("--target-tensor-parallel-size", "--target-pipeline-parallel-size", "--target-expert-parallel-size"):
        # before the source's sizes stand in for an absent one: 0 is no size, not "the source's"
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    ep = args.target_expert_parallel_size or src.get("expert_model_parallel_size") or 1
    tp = args.target_tensor_parallel_size or src.get("tensor_model_parallel_size") or 1
    pp = args.target_pipeline_parallel_size or src.get("pipeline_model_parallel_size") or 1
    same_pp = args.target_pipeline_parallel_size is None
    split = (args.target_num_layers_per_virtual_pipeline_stage, args.target_decoder_first_pipeline_num_layers,
             args.target_decoder_last_pipeline_num_layers, args.target_pipeline_model_parallel_layout,
             args.target_account_for_embedding_in_pipeline_split, args.target_account_for_loss_in_pipeline_split)
    if same_pp and split == (None,) * len(SPLIT_FLAGS):
        split = tuple(src.get(k) for k in SPLIT_FLAGS)
    split = split[:4] + tuple(bool(v) for v in split[4:])
    check_expert_size(src, ep)
    etp = args.target_expert_tensor_parallel_size
    if etp is None:  # the source's experts: split like its dense layers, whole, or on their own grid
        etp = src.get("expert_tensor_parallel_size")
        etp = None if etp == (src.get("tensor_model_parallel_size") or 1) and etp != 1 else etp
    return TargetLayout(tp, pp, *split, ep=ep, etp=etp, dp=args.target_data_parallel_size)


# flat config fields that are no model option: the vocabulary (from the tokenizer flags), how the run began
NOT_MODEL = ("vocab_size", "moe_use_upcycling", "moe_upcycling_granularity")


def _default(f):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def pretrain_flags(config: dict, release: bool, optimizer: bool = False) -> list[str]:
    """The pretrain_gpt.py (pretrain_bert.py) flags that load a converted checkpoint with this flat
    ``config``: the model and MoE options that differ from their defaults, the parallel layout, and how to resume."""
    flags = []
    for cls in (ModelConfig, ParallelConfig, MoEConfig):
        for f in dataclasses.fields(cls):
            value = config.get(f.name)
            if not f.metadata.get("cli", True) or f.name in NOT_MODEL or value is None or value == _default(f):
                continue
            if cls is ParallelConfig and not (f.name.endswith(("_parallel_size", "pipeline_stage", "_num_layers",
                                                               "_in_pipeline_split"))
                                              or f.name in ("sequence_parallel", "pipeline_model_parallel_layout")):
                continue  # the layout only, not how this run was optimised
            flag = "--" + f.name.replace("_", "-")
            values = [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]  # quoted when printed
            off = ["--no-" + flag[2:]] if _default(f) is True else []  # on by default: --no-<flag> turns it off
            flags += [flag] if value is True else off if value is False else [flag, *values]
    groups = config.get("num_query_groups")
    if groups not in (None, config.get("num_attention_heads")) and "--group-query-attention" not in flags:
        flags.append("--group-query-attention")  # --num-query-groups is refused without it
    if config.get("bert_no_binary_head"):
        flags.append("--bert-no-binary-head")
    if not (config.get("swiglu") or config.get("disable_bias_linear") or tanh_gelu(config)):
        flags.append("--no-bias-gelu-fusion")  # an exact-GeLU model: the default fused GeLU is the tanh one
    return flags + ([] if release else ["--no-load-rng"] if optimizer else ["--no-load-optim", "--no-load-rng"])


def _save_megatron(bundle: ModelBundle, args, progress=_no_progress, write_tokenizer=None) -> str:
    """Write the checkpoint; returns what to tell the user (where, and the flags that load it)."""
    layout = target_layout(bundle, args)
    out = save_megatron(bundle, args.save_dir, layout, progress, write_tokenizer)
    config = target_config(bundle, layout)
    flags = pretrain_flags(config, bundle.iteration == "release", bundle.optimizer is not None)
    if num_experts(config) and layout.ep > 1 and layout.etp is None and layout.tp > 1:
        # --expert-tensor-parallel-size defaults to TP: said, as the experts' grid sets the ranks needed
        at = flags.index("--expert-model-parallel-size") + 2
        flags[at:at] = ["--expert-tensor-parallel-size", str(layout.tp)]
    words = shell_words(["--load", args.save_dir, *flags])
    return f"{out}\n{ranks_needed(layout, bool(num_experts(config)))}\nload it with: {words} (and the tokenizer flags)"


def ranks_needed(layout: TargetLayout, experts: bool) -> str:
    """The line saying how many ranks run the written layout: TP x PP x the smallest data-parallel size
    its experts' grid fits (EP inside DP; a folded grid's ETP x EP dividing TP x DP)."""
    tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.etp_size
    if layout.dp is not None:
        dp = layout.dp
    elif experts and layout.folded:
        dp = etp * ep // math.gcd(tp, etp * ep)
    else:
        dp = ep if experts else 1
    world = tp * pp * dp
    if world == 1:
        return "run it on any number of ranks (TP1 x PP1: data- or context-parallel)"
    if dp == 1:
        return f"run it on a multiple of {world} ranks (TP{tp} x PP{pp}, times the data- or context-parallel size)"
    return (f"run it on a multiple of {world} ranks (TP{tp} x PP{pp} x DP{dp}: the experts' grid EP{ep} x ETP{etp} "
            f"needs a data-parallel size that is a multiple of {dp})")


def shell_words(words: list[str]) -> str:
    """``words`` as one shell line: a value bash would glob or split (``--moe-layer-freq [1,0,1]``, a
    path with a space) is quoted, so the printed flags paste into a shell as they are."""
    return " ".join(shlex.quote(str(w)) for w in words)


# ---------------------------------------------------------------------------------------------
# hf


def _hf_loader_args(parser) -> None:
    group = parser.add_argument_group("hf loader")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                       help="Vocabulary padding of the imported model, as in training (default 128).")
    group.add_argument("--moe-grouped-gemm", action="store_true", default=None,
                       help="Mixtral / Qwen3-MoE / DeepSeek-V3 import: write the experts stacked for --moe-grouped-gemm "
                            "(default: one MLP each).")
    group.add_argument("--apply-layernorm-1p", action="store_true", default=None,
                       help="Store the imported norm weights zero-centred (weight - 1) for a --apply-layernorm-1p run.")


def _load_hf(args, progress=_no_progress) -> ModelBundle:
    divisor = args.make_vocab_size_divisible_by  # 0 was taken as the default
    if divisor is not None and divisor < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by must be at least 1, got {divisor}")
    return load_hf(args.load_dir, 128 if divisor is None else divisor, bool(args.moe_grouped_gemm),
                   bool(args.apply_layernorm_1p))


def _hf_saver_args(parser) -> None:
    group = parser.add_argument_group("hf saver")
    group.add_argument("--hf-style", choices=STYLES, default=None,
                       help="gpt2 (learned positions, LayerNorm, GeLU), llama (RoPE, RMSNorm, SwiGLU), mixtral "
                            "(llama with MoE layers), gpt_oss (MoE with biases, attention sinks, clamped --quick-geglu "
                            "experts, YaRN, sliding windows), qwen2 (llama with biases on q/k/v only; sliding windows per layer), "
                            "qwen3 / qwen3_moe (llama / MoE with --qk-layernorm), mistral (llama without biases, a sliding "
                            "window in every layer), deepseek_v3 (multi-latent "
                            "attention, MoE, MTP) or bert (MegatronBertForPreTraining); auto: bert for BERT, "
                            "deepseek_v3 for MLA / MTP models, gpt_oss for MoE models with --quick-geglu or --softmax-type, "
                            "qwen3(_moe) for --qk-layernorm, mixtral for other MoE models, "
                            "qwen2 for rope models with --add-qkv-bias --disable-bias-linear, mistral for rope models with "
                            "--window-size, llama for other rope models, else gpt2.")
    group.add_argument("--max-shard-size", default=None,
                       help="Largest safetensors file (default 5GB); bigger models are split into shards with an index.")
    group.add_argument("--merge-lora", action="store_true", default=None,
                       help="LoRA checkpoint: export the merged model (W + alpha/r B A) instead of the base plus a "
                            "PEFT adapter in <save-dir>/adapter.")


def _save_hf(bundle: ModelBundle, args, progress=_no_progress) -> str:
    """A Hugging Face folder; a LoRA source gives its base plus a PEFT adapter (or, --merge-lora, the merged model)."""
    from ..lora.convert import merged_bundle  # (the lora package imports this one)
    from ..lora.peft_export import ADAPTER_DIR, peft_adapter, save_peft_adapter

    if args.merge_lora and bundle.adapters is None:
        raise ConfigError(f"--merge-lora: {args.load_dir} is not a LoRA checkpoint; drop it")
    if bundle.adapters is not None and args.merge_lora:
        bundle = merged_bundle(bundle)
    style = pick_style(bundle.config, args.hf_style or "auto")
    if bundle.adapters is not None:  # refused before anything is written when the adapter cannot be exported
        peft_adapter(bundle.config, bundle.adapters, style, args.save_dir)
    def adapter(folder):  # written with the base: both in place, or neither
        save_peft_adapter(bundle.config, bundle.adapters, style, args.save_dir, folder)

    out = save_hf(bundle, args.save_dir, style, args.max_shard_size or "5GB", progress,
                  None if bundle.adapters is None else adapter)
    if bundle.adapters is None:
        return out
    where = os.path.join(args.save_dir, ADAPTER_DIR)
    return out.replace(args.save_dir, f"{args.save_dir} (the base) and its PEFT adapter {where}", 1)


def _save_megatron_with_tokenizer(bundle: ModelBundle, args, progress=_no_progress) -> str:
    """The megatron saver also keeps the source's tokenizer files (in ``<save>/tokenizer``); a LoRA
    source is written with its adapters merged into the base weights."""
    if bundle.adapters is not None:
        from ..lora.convert import merged_bundle  # (the lora package imports this one)

        bundle = merged_bundle(bundle)
    bert = args.model_type == "BERT"

    def write_tokenizer(staged):  # staged with the model files, in place before the tracker
        copy_tokenizer_files(bundle.tokenizer_files, staged)
        if bert:  # a transformers BERT may ship only tokenizer.json: the BERT tools read a vocab.txt
            add_bert_vocab_txt(staged)

    out = _save_megatron(bundle, args, progress, write_tokenizer)
    folder = os.path.join(args.save_dir, TOKENIZER_DIR)
    found = tokenizer_in_folder(folder, bert)
    if found and not bundle.config.get("tokenizer_type"):  # say which tokenizer flags load the kept files
        load = f"load it with: {shell_words(['--load', args.save_dir])} "
        out = out.replace(" (and the tokenizer flags)", "").replace(load, load + shell_words(tokenizer_flags(found)) + " ")
    return out


LOADERS = {"megatron": Plugin(_megatron_loader_args, _load_megatron), "hf": Plugin(_hf_loader_args, _load_hf)}
SAVERS = {"megatron": Plugin(_megatron_saver_args, _save_megatron_with_tokenizer),
          "hf": Plugin(_hf_saver_args, _save_hf)}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(description="Convert checkpoints between layouts and formats.", allow_abbrev=False)
    parser.add_argument("--model-type", required=True, choices=["GPT", "BERT"], help="Model family.")
    parser.add_argument("--loader", default="megatron", choices=sorted(LOADERS), help="Format of --load-dir.")
    parser.add_argument("--saver", default="megatron", choices=sorted(SAVERS), help="Format to write.")
    parser.add_argument("--load-dir", required=True, help="Checkpoint to read (save folder or Hugging Face folder).")
    parser.add_argument("--save-dir", required=True, help="Folder to write to (new or empty).")
    for plugins in (LOADERS, SAVERS):
        for plugin in plugins.values():
            plugin.add_arguments(parser)
    return parser


# Options that only one plugin reads: given to another, they are refused rather than ignored.
PLUGIN_OPTIONS = {
    ("saver", "megatron"): ("target_tensor_parallel_size", "target_pipeline_parallel_size", "target_expert_parallel_size",
                            "target_expert_tensor_parallel_size", "target_data_parallel_size",
                            "target_num_layers_per_virtual_pipeline_stage", "target_decoder_first_pipeline_num_layers",
                            "target_decoder_last_pipeline_num_layers", "target_pipeline_model_parallel_layout",
                            "target_account_for_embedding_in_pipeline_split",
                            "target_account_for_loss_in_pipeline_split"),
    ("saver", "hf"): ("hf_style", "max_shard_size", "merge_lora"),
    ("loader", "hf"): ("make_vocab_size_divisible_by", "moe_grouped_gemm", "apply_layernorm_1p"),
}


def check_options(args) -> None:
    """Refuse an option the chosen loader/saver does not read, naming it."""
    if os.path.abspath(args.load_dir) == os.path.abspath(args.save_dir):
        raise ConfigError("--save-dir must differ from --load-dir")
    for (role, name), options in PLUGIN_OPTIONS.items():
        if getattr(args, role) == name:
            continue
        for option in options:
            if getattr(args, option, None) is not None:
                raise ConfigError(f"--{option.replace('_', '-')} applies to --{role} {name} only; drop it")


def convert(args, progress=_no_progress) -> str:
    """Run the loader then the saver named in ``args``; returns what the saver wrote."""
    check_options(args)
    bundle = LOADERS[args.loader].run(args, progress)
    check_model_type(bundle.config, args.model_type, args.load_dir)
    return SAVERS[args.saver].run(bundle, args, progress)
