"""Validation of the precision flags (bf16/fp16, loss scaling, FP8, the linear-layer implementation).

The FP8 recipe's own values (format, recipe, amax algorithm, history length, bf16 layers) are
checked where they are used, by :class:`~megatron_lite.precision.fp8.Fp8Recipe` and
:class:`~megatron_lite.models.transformer_config.TransformerConfig`; here are the rules that tie
the precision flags to each other and to the machine.
"""

from __future__ import annotations

import importlib

import torch

from ..errors import ConfigError

TRANSFORMER_IMPLS = ("local", "transformer_engine")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def gpu_visible() -> bool:
    """Whether a CUDA GPU is visible (Transformer Engine's kernels need one)."""
    return torch.cuda.is_available()


def transformer_engine_missing() -> list[str]:
    """What ``--transformer-impl transformer_engine`` lacks here (empty when TE and a GPU are present)."""
    missing = []
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # not installed, or installed without a usable build (e.g. no CUDA libraries)
        missing.append("Transformer Engine is not installed (or does not import)")
    if not gpu_visible():
        missing.append("no CUDA GPU is visible")
    return missing


def check_precision_flags(pr) -> None:
    """Raise ConfigError (one line naming the flag and the fix) for a bad precision combination."""
    _require(not (pr.bf16 and pr.fp16), "--bf16 and --fp16 are mutually exclusive; pick one")
    _require(pr.loss_scale is None or pr.fp16 or pr.bf16,
             "--loss-scale needs --fp16 or --bf16 (fp32 training is not loss-scaled); drop it")
    _require(pr.loss_scale is None or pr.loss_scale > 0, f"--loss-scale must be positive, got {pr.loss_scale}")
    if pr.fp16:
        _require(pr.initial_loss_scale > 0 and pr.min_loss_scale > 0,
                 "--initial-loss-scale and --min-loss-scale must be positive")
        _require(pr.loss_scale is not None or pr.min_loss_scale <= pr.initial_loss_scale,
                 f"--min-loss-scale {pr.min_loss_scale} is larger than --initial-loss-scale "
                 f"{pr.initial_loss_scale} (an overflow would raise the scale to the floor); lower it")
        _require(pr.loss_scale_window >= 1 and pr.hysteresis >= 1, "--loss-scale-window and --hysteresis must be at least 1")
    _require(pr.transformer_impl in TRANSFORMER_IMPLS,
             f"--transformer-impl {pr.transformer_impl}: expected one of {', '.join(TRANSFORMER_IMPLS)}")
    if pr.transformer_impl == "transformer_engine":
        missing = transformer_engine_missing()
        _require(not missing, f"--transformer-impl transformer_engine: {' and '.join(missing)}; "
                              "use --transformer-impl local (native FP8 GEMMs)")
    _check_fp8_only_flags(pr)
    _check_16_bit_only_flags(pr)
    if pr.fp8_format is not None:
        _require(pr.bf16, f"--fp8-format {pr.fp8_format} needs --bf16 (the FP8 GEMMs take and return bf16 "
                          "tensors and the rest of the model runs in bf16); add --bf16")
        # TE's current-scaling and block recipes have no high-precision wgrad switch (te.te_recipe says the same)
        _require(not (pr.transformer_impl == "transformer_engine" and pr.no_fp8_wgrad and pr.fp8_recipe != "delayed"),
                 f"--no-fp8-wgrad with --fp8-recipe {pr.fp8_recipe} is not available through Transformer Engine; "
                 "use --fp8-recipe delayed or --transformer-impl local")


# (flag, field, default): flags that only shape FP8 training; set without --fp8-format they would change nothing
FP8_ONLY_FLAGS = (("--fp8-recipe", "fp8_recipe", "delayed"), ("--fp8-margin", "fp8_margin", 0),
                  ("--fp8-amax-history-len", "fp8_amax_history_len", 1),
                  ("--fp8-amax-compute-algo", "fp8_amax_compute_algo", "most_recent"),
                  ("--no-fp8-wgrad", "no_fp8_wgrad", False), ("--first-last-layers-bf16", "first_last_layers_bf16", False))
BF16_LAYER_COUNTS = (("--num-layers-at-start-in-bf16", "num_layers_at_start_in_bf16", 1),
                     ("--num-layers-at-end-in-bf16", "num_layers_at_end_in_bf16", 1))


SIXTEEN_BIT_ONLY_FLAGS = (("--fp32-residual-connection", "fp32_residual_connection", False),
                          ("--attention-softmax-in-fp32", "attention_softmax_in_fp32", False),
                          ("--apply-query-key-layer-scaling", "apply_query_key_layer_scaling", False))


def _check_16_bit_only_flags(pr) -> None:
    """The 16-bit numerics flags keep parts of a --bf16/--fp16 model in fp32; an fp32 run already is."""
    flag = _set_flag(pr, SIXTEEN_BIT_ONLY_FLAGS)
    _require(pr.bf16 or pr.fp16 or flag is None,
             f"{flag} has no effect in fp32 training (everything already computes in fp32); add --bf16 or --fp16, "
             "or drop it")


def _set_flag(pr, table) -> str | None:
    """The first flag of ``table`` whose value is not its default, as it would be typed (None: none is set)."""
    for flag, field, default in table:
        value = getattr(pr, field)
        if value != default:
            return flag if isinstance(value, bool) else f"{flag} {value}"
    return None


def _check_fp8_only_flags(pr) -> None:
    """An FP8 recipe flag without --fp8-format (or a bf16 layer count without --first-last-layers-bf16)
    would be accepted and change nothing: the run would train in bf16 while its script says otherwise."""
    flag = _set_flag(pr, FP8_ONLY_FLAGS)
    _require(pr.fp8_format is not None or flag is None,
             f"{flag} has no effect without --fp8-format (the run would not use FP8); "
             "add --fp8-format hybrid (or e4m3) or drop it")
    count = _set_flag(pr, BF16_LAYER_COUNTS)
    _require(pr.first_last_layers_bf16 or count is None,
             f"{count} has no effect without --first-last-layers-bf16; add --first-last-layers-bf16 or drop it")
