"""Megatron-LM training flags that megatron_lite does not take, each with why and what to do instead.

A Megatron-LM launch script pasted here meets this table at the command line: a flag in it is
refused in one line (exit 2) that says it is a Megatron-LM flag, why it is absent and the fix (our
flag, or "drop it"). A flag that is neither ours nor Megatron-LM's gets argparse's message plus the
closest flag of ours, if one is close (:func:`unknown_flag_message`). A Megatron-LM value of a flag we
have that we do not take (``--optimizer dist_muon``) is refused the same way (:data:`REFUSED_VALUES`).

The table (megatron_flag_table.py) holds the names from Megatron-LM's ``megatron/training/arguments.py``
and newer versions' config dataclasses (and a few older aliases its example scripts used). Megatron-LM
flags that megatron_lite accepts are its own flags (the config fields); a flag added to our parser must
leave the table (tests/unit/test_megatron_flags.py says which one).
"""

from __future__ import annotations

import argparse
import difflib

from .megatron_flag_table import ENTRIES

REFUSED: dict[str, tuple[str, str]] = {flag: (why, fix) for flags, why, fix in ENTRIES for flag in flags.split()}
"""Every Megatron-LM flag megatron_lite refuses: flag -> (why it is absent, the fix)."""


_SORTS = "use --position-embedding-type rope or learned_absolute"
REFUSED_VALUES: dict[str, dict[str, tuple[str, str]]] = {
    "--tokenizer-type": {
        "MultimodalTokenizer": ("multimodal models are not implemented", "use --tokenizer-type HuggingFaceTokenizer"),
        "NullMultimodalTokenizer": ("multimodal models are not implemented", "use --tokenizer-type NullTokenizer"),
        "SFTTokenizer": ("--sft applies the tokenizer's own chat template", "use --sft with --tokenizer-type "
                         "HuggingFaceTokenizer"),
    },
    "--optimizer": {"dist_muon": ("the layer-wise distributed Muon (each data-parallel rank stepping whole matrices) "
                                  "is not built", "use --optimizer muon (without --use-distributed-optimizer)")},
    "--position-embedding-type": {
        "mrope": ("multimodal rotary embeddings are not implemented", _SORTS),
        "relative": ("relative position embeddings (T5) are not implemented", _SORTS),
        "none": ("a model without position embeddings is not built", _SORTS),
    },
    "--ckpt-format": {v: ("only Megatron-LM's torch and torch_dist layouts are written", "use --ckpt-format "
                          "torch_dist (sharded, loads at any layout) or torch") for v in ("zarr", "torch_dcp",
                                                                                           "fsdp_dtensor")},
    "--fp8-recipe": {"custom": ("custom quantizers (--fp8-quantizer-factory) are not implemented",
                                "use --fp8-recipe delayed, tensorwise, blockwise or mxfp8")},
    "--dataloader-type": {"external": ("an outside data loader cannot be plugged in",
                                       "use --dataloader-type single or cyclic")},
    "--attention-backend": {
        **{v: ("the attention kernel is picked per call (flash-attn when installed and the inputs allow it, else "
               "PyTorch SDPA)", "use --attention-backend auto or drop it") for v in ("flash", "fused", "local")},
        "unfused": ("the attention kernel is picked per call; the explicit softmax math is --no-masked-softmax-fusion",
                    "use --no-masked-softmax-fusion"),
    },
    **{flag: {v: (f"{what} always fp32 here ({v} {kind} not built; --use-precision-aware-optimizer keeps only "
                  "Adam's moments in bf16)", f"use {flag} fp32 or drop it") for v in ("bf16", "fp16", "fp8")}
       for flag, what, kind in (("--main-grads-dtype", "main gradients are", "gradient accumulation and reduction is"),
                                ("--main-params-dtype", "master weights are", "master weights are"))},
    **{flag: {"fp16": ("fp16 moments need a per-tensor scale (Megatron-LM's Transformer Engine Adam keeps one) that "
                       "is not built", f"use {flag} bf16 with --use-precision-aware-optimizer"),
              "fp8": ("fp8 moments need a per-tensor scale (Megatron-LM's Transformer Engine Adam keeps one) that "
                      "is not built", f"use {flag} bf16 with --use-precision-aware-optimizer")}
       for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype")},
    "--megatron-fsdp-grad-comm-dtype": {v: ("gradients are always reduced in fp32",
                                            "use --megatron-fsdp-grad-comm-dtype fp32 or drop it")
                                        for v in ("bf16", "fp16", "auto")},
}
"""Values of flags we have that Megatron-LM takes and megatron_lite does not: flag -> value -> (why, fix)."""


BERT_ONLY = ("--bert-no-binary-head", "--mask-prob", "--short-seq-prob", "--bert-load")
"""pretrain_bert.py's own flags (its BertConfig section): another script names the script that takes them."""


COMMA_PAIRS = ("--window-size",)
"""Flags Megatron-LM parses as one "A,B" argument (its tuple type) that take two values here."""


def megatron_value_message(argv: list[str]) -> str | None:
    """The one-line refusal of the first Megatron-LM value in ``argv`` that we do not take
    (``--flag value`` or ``--flag=value``), or None."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if (flag in REFUSED_VALUES or flag in COMMA_PAIRS) and not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if flag in COMMA_PAIRS and "," in value:  # Megatron-LM's tuple spelling of a two-value flag
            return (f"{flag} {value} is Megatron-LM's spelling of two values; write them apart: "
                    f"{flag} {' '.join(value.strip('()').split(','))}")
        entry = REFUSED_VALUES.get(flag, {}).get(value)
        if entry is not None:
            return f"{flag} {value} is a Megatron-LM choice that megatron_lite does not support: {entry[0]}; {entry[1]}"
    return None


def megatron_flag_message(flag: str) -> str | None:
    """The one-line refusal of a Megatron-LM flag we do not take, or None when ``flag`` is not one."""
    entry = REFUSED.get(flag)
    if entry is None:
        return None
    why, fix = entry
    return f"{flag} is a Megatron-LM flag that megatron_lite does not support: {why}; {fix}"


def bert_flag_message(flag: str) -> str | None:
    """The one-line refusal of pretrain_bert.py's flag ``flag`` by another script, or None."""
    if flag not in BERT_ONLY:
        return None
    return f"{flag} is pretrain_bert.py's flag (BERT pretraining), not this script's: drop it, or train BERT with pretrain_bert.py"


def unknown_flag_message(extras: list[str], known: list[str]) -> tuple[str, bool]:
    """argparse's error for unrecognised arguments ``extras`` (``--flag=value`` or ``--flag value``), and
    whether it is a refusal that names its fix: a Megatron-LM flag's if one of them is such a flag, else a
    flag of pretrain_bert.py's (:data:`BERT_ONLY`), else the first unknown flag with the closest of ``known``. The other unrecognised flags are named after it, so one
    line covers a pasted script."""
    flags = [a.split("=", 1)[0] for a in extras if a.startswith("--")]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}", False
    first = next((f for f in flags if f in REFUSED), None) or next((f for f in flags if f in BERT_ONLY), flags[0])
    message = megatron_flag_message(first) or bert_flag_message(first)
    if message is None:
        close = difflib.get_close_matches(first, known, n=1, cutoff=0.8)
        message = f"unrecognized arguments: {first}" + (f" (did you mean {close[0]}?)" if close else "")
    others = [f for f in dict.fromkeys(flags) if f != first]
    if others:
        message += f" [also not recognized: {' '.join(others)}]"
    return message, first in REFUSED or first in BERT_ONLY


class RefusedFlag(argparse.Action):
    """For a tool's parser: a Megatron-LM flag its Megatron-LM counterpart takes (``--vocab-extra-ids``
    in ``preprocess_data.py``) that training here refuses. The tool refuses it with training's line
    (:func:`megatron_flag_message`), not argparse's "unrecognized arguments"; hidden from ``--help``."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(nargs="?", help=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(megatron_flag_message(option_string))
