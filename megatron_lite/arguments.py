"""The command line: argparse flags generated from the config dataclasses, then validated.

``parse_args(argv)`` returns a validated :class:`~megatron_lite.config.Config`; a bad flag
combination prints one line naming the flag and the fix and exits with code 2.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import sys
import time
import typing

from .config import SECTIONS, Config, ConfigError
from .config_checks import finalize
from .errors import PEER_EXIT_GRACE_S, OneLineParser
from .fusions.config import FUSION_CHOICES
from .megatron_flags import megatron_value_message, unknown_flag_message
from .models.mla_config import ROPE_TYPES
from .models.transformer_config import (
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
)
from .moe.config import MOE_CHOICES
from .optim.muon_config import MUON_CHOICES
from .optim.wd_schedule import WD_INCR_STYLES
from .parallel.attention_sink import SOFTMAX_TYPES
from .parallel.context import CP_COMM_TYPES
from .precision.flags import TRANSFORMER_IMPLS
from .precision.fp8 import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES
from .training.rerun_flags import ERROR_INJECTION_TYPES, RERUN_MODES

CHOICES = {
    **MOE_CHOICES,
    **FUSION_CHOICES,
    **MUON_CHOICES,
    "position_embedding_type": list(POSITION_EMBEDDING_TYPES),
    "softmax_type": list(SOFTMAX_TYPES),
    "distributed_backend": ["nccl", "gloo"],
    "empty_unused_memory_level": [0, 1, 2],
    "rope_type": list(ROPE_TYPES),
    "normalization": list(NORMALIZATIONS),
    "recompute_granularity": list(RECOMPUTE_GRANULARITIES),
    "recompute_method": list(RECOMPUTE_METHODS),
    "cp_comm_type": list(CP_COMM_TYPES),
    "optimizer": ["adam", "sgd", "muon"],
    "rerun_mode": list(RERUN_MODES),
    "error_injection_type": list(ERROR_INJECTION_TYPES),
    "ckpt_format": ["torch", "torch_dist"],
    "non_persistent_ckpt_type": ["global", "local", "in_memory"],  # local / in_memory: refused in one line
    "pipeline_schedule": ["1f1b", "zb-h1"],
    "timing_log_level": [0, 1, 2],
    "dataloader_type": ["single", "cyclic"],
    "lr_decay_style": ["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    "lr_wsd_decay_style": ["exponential", "linear", "cosine", "minus_sqrt"],
    "weight_decay_incr_style": list(WD_INCR_STYLES),
    "fp8_format": list(FP8_FORMATS),
    "data_parallel_sharding_strategy": ["no_shard", "optim", "optim_grads", "optim_grads_params"],
    "fp8_recipe": list(FP8_RECIPES),
    "fp8_amax_compute_algo": list(AMAX_COMPUTE_ALGOS),
    "transformer_impl": list(TRANSFORMER_IMPLS),
    **dict.fromkeys(("main_grads_dtype", "main_params_dtype",
                     "megatron_fsdp_grad_comm_dtype"), ["fp32"]),  # inert: what always happens (other values refused)
    **dict.fromkeys(("exp_avg_dtype", "exp_avg_sq_dtype"), ["fp32", "bf16"]),  # fp16 and fp8 refused
    "tokenizer_type": [
        "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer",
        "HuggingFaceTokenizer", "NullTokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
    ],
    "tiktoken_pattern": ["v1", "v2"],
}


METAVARS = {int: "N", float: "X", str: "VALUE"}


def _help(doc: str, default, kind) -> str:
    """The field's help text with its default, as ``--help`` shows it (switches show none)."""
    if kind is bool:
        return f"{doc} (default: on)" if default else doc
    if default is None:
        return doc
    shown = " ".join(map(str, default)) if isinstance(default, list) else default
    return f"{doc} (default: {shown})".replace("%", "%%")


@functools.cache  # the sources do not change while a process runs; parsing them was most of a parser's build
def _field_docs(cls) -> dict[str, str]:
    """The string literal under each field is its help text (fields of base dataclasses included); read-only."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = nxt.value.value
    return docs


class RankZeroParser(OneLineParser):
    """A OneLineParser that prints (errors, help) only on rank 0 of a torchrun launch: every rank
    still exits with code 2 on a bad flag, but the message appears once."""

    def _print_message(self, message, file=None):
        if int(os.environ.get("RANK", "0")) == 0:
            super()._print_message(message, file)

    def exit(self, status=0, message=None):
        if status and int(os.environ.get("RANK", "0")) != 0:
            time.sleep(PEER_EXIT_GRACE_S)  # let rank 0 print before torchrun stops the workers
        super().exit(status, message)

    def parse_args(self, args=None, namespace=None):
        """A Megatron-LM flag we lack, or a Megatron-LM value of a flag we have, is refused with its reason
        and fix (megatron_flags.py); another unrecognised flag gets the closest flag of ours."""
        message = megatron_value_message(sys.argv[1:] if args is None else list(args))
        if message:
            self.exit(2, f"{self.prog}: error: {message}\n")
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            message, megatron = unknown_flag_message(extras, [s for s in self._option_string_actions
                                                              if s.startswith("--")])
            if megatron:  # the message ends with the fix
                self.exit(2, f"{self.prog}: error: {message}\n")
            self.error(message)
        return ns


def build_parser(description: str = "", extra_sections: dict | None = None) -> argparse.ArgumentParser:
    """argparse parser with one flag per config field, grouped by section."""
    parser = RankZeroParser(description=description, allow_abbrev=False)
    sections = {name: typing.get_type_hints(Config)[name] for name in SECTIONS}
    sections.update(extra_sections or {})
    for section, cls in sections.items():
        group = parser.add_argument_group(section)
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        own = cls.__dict__.get("__annotations__", {})  # a section's own flags first, then its mixins'
        for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
            if not f.metadata.get("cli", True):
                continue
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))  # a few Megatron flags keep an underscore
            flags = [flag, *f.metadata.get("aliases", ())]  # Megatron-LM's second spellings
            kind = hints[f.name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = f.metadata.get("cli_default", default)  # --train-iters: unset, so that a clash is seen
            kwargs = dict(dest=f"{section}.{f.name}", default=default, help=_help(docs.get(f.name, ""), default, kind))
            if kind is bool:  # on by default: --no-<flag> turns it off
                group.add_argument(*flags, action=argparse.BooleanOptionalAction if default else "store_true", **kwargs)
                continue
            if typing.get_origin(kind) is not list:  # ``X | None`` -> X; a plain ``list[X]`` stays whole
                kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
            base = kind
            if typing.get_origin(base) is list:  # every list field takes several values, as in Megatron
                kwargs["nargs"] = f.metadata.get("nargs", "+")
                base = typing.get_args(base)[0]
            kwargs["type"] = base
            if f.name in CHOICES:
                kwargs["choices"] = CHOICES[f.name]
            else:  # "--num-layers N", not the internal destination "--num-layers MODEL.NUM_LAYERS"
                kwargs["metavar"] = f.metadata.get("metavar", METAVARS.get(base, "VALUE"))
            group.add_argument(*flags, **kwargs)
    return parser


def config_from_namespace(ns: argparse.Namespace, cls=Config, extra_sections: dict | None = None):
    values: dict[str, dict] = {}
    for key, value in vars(ns).items():
        section, name = key.split(".", 1)
        values.setdefault(section, {})[name] = value
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for section in SECTIONS:
        kwargs[section] = hints[section](**values.get(section, {}))
    config = cls(**kwargs)
    for section, section_cls in (extra_sections or {}).items():
        setattr(config, section, section_cls(**values.get(section, {})))
    config.extra_sections = tuple(extra_sections or {})  # included in config.flat() (saved with checkpoints)
    return config


def parse_args(argv=None, description: str = "", world_size: int | None = None, extra_sections=None,
               checks=None, data_from_script: bool = False) -> Config:
    """Parse and validate flags for ``world_size`` processes (default: torchrun's WORLD_SIZE, else 1);
    on a user error print one line and exit with code 2. ``checks(config)`` (optional): the script's
    own flag rules, raising ConfigError; run here so that MEGATRON_LITE_CHECK_ARGS=1 applies them too.
    ``data_from_script``: the script's own datasets provider brings the data, so neither ``--data-path``
    nor ``--mock-data`` is asked for (the vocabulary still comes from ``--vocab-size`` or a tokenizer)."""
    parser = build_parser(description, extra_sections)
    ns = parser.parse_args(argv)
    config = config_from_namespace(ns, extra_sections=extra_sections)
    try:
        if world_size is None:
            world_size = _env_world_size()
        if config.checkpoint.use_checkpoint_args:
            _take_checkpoint_args(config, sys.argv[1:] if argv is None else list(argv))
        if checks is not None:  # first: the script's refusals (GPT-only flags) name its fix, not the generic one
            checks(config)
        finalize(config, world_size, data_from_script=data_from_script)
    except ConfigError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if os.environ.get(CHECK_ARGS_ENV, "0") not in ("", "0"):
        print(args_summary(config))
        parser.exit(0)
    return config


def _env_world_size() -> int:
    """torchrun's WORLD_SIZE (1 when unset); one set by hand for MEGATRON_LITE_CHECK_ARGS may be a typo."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={value!r} is not a whole number of processes; set it to one "
                          "(e.g. WORLD_SIZE=8) or leave it to the launcher") from None


def _take_checkpoint_args(config: Config, argv: list[str]) -> None:
    """--use-checkpoint-args: the architecture flags from the checkpoint at --load (said on rank 0);
    ``argv``: the command line, for the flags taken only when left out."""
    from .checkpoint.arch import apply_checkpoint_args
    from .checkpoint.format import CheckpointError

    try:
        changed = apply_checkpoint_args(config, tuple(argv))
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    if changed and int(os.environ.get("RANK", "0")) == 0:
        print(f"> --use-checkpoint-args: model flags from {config.checkpoint.load}: {', '.join(changed)}", flush=True)


CHECK_ARGS_ENV = "MEGATRON_LITE_CHECK_ARGS"
"""Set to 1 to only validate the flags: any training script exits 0 after parsing and validating
them for WORLD_SIZE processes (no process group, no data, no model), e.g. for a 1024-GPU script:
``MEGATRON_LITE_CHECK_ARGS=1 WORLD_SIZE=1024 python pretrain_gpt.py <its flags>``."""


def args_summary(config: Config) -> str:
    """One line: the layout and batch the flags give for this world size."""
    p, t = config.parallel, config.training
    micro_batches = t.global_batch_size // (t.micro_batch_size * config.data_parallel_size)
    cp = f"CP {p.context_parallel_size} x " if p.context_parallel_size > 1 else ""  # world = TP x PP x CP x DP
    trained = micro_batches * t.micro_batch_size * config.data_parallel_size  # < G: --decrease-batch-size-if-needed
    rounded = f" rounded down to {trained}" if trained != t.global_batch_size else ""
    return (
        f"arguments valid for world size {config.world_size}: TP {p.tensor_model_parallel_size} x "
        f"PP {p.pipeline_model_parallel_size} x {cp}DP {config.data_parallel_size}, global batch "
        f"{t.global_batch_size}{rounded} = micro-batch {t.micro_batch_size} x {micro_batches} micro-batches x "
        f"DP {config.data_parallel_size}"
        + (f", ramped up from {t.rampup_batch_size[0]} by {t.rampup_batch_size[1]} over {t.rampup_batch_size[2]} "
           f"samples ({t.train_iters} iterations)" if t.rampup_batch_size else "")
    )
