"""The model flags a checkpoint was saved with: resuming refuses other values, and
``--use-checkpoint-args`` takes them from the checkpoint.

The flags are listed once, in :data:`megatron_lite.arch_flags.ARCHITECTURE_FLAGS`. Those that decide
parameter shapes would fail the load anyway (the message names them); the others (``--openai-gelu``,
``--rotary-base``, ``--norm-epsilon``, the router's top-k, ...) keep every shape, so without this
check a resumed run would silently go on as another model. A weights-only load (``--finetune``,
``--pretrained-checkpoint``) checks only :data:`~megatron_lite.arch_flags.SHAPE_FLAGS`: there a change
of the others can be deliberate.
"""

from __future__ import annotations

import shlex

from ..arch_flags import ARCHITECTURE_FLAGS, DERIVED_FLAGS, SHAPE_FLAGS
from ..config import SECTIONS
from ..fusions.config import tanh_gelu
from .format import (
    ARCH_FIELDS,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_config,
    iteration_dir,
    read_tracker,
)

# The shape a value of these flags gives, where only some of their values add parameters: a weights-only
# load compares that (--softmax-type vanilla and off-by-one hold the same tensors; learnable adds the sinks).
SHAPE_OF = {"softmax_type": lambda value: value == "learnable"}


LEARNED = "learned_absolute"  # --position-embedding-type of a model with a table of max-position-embeddings rows

NULL_TOKENIZERS = (None, "NullTokenizer")  # --tokenizer-type values whose vocabulary is --vocab-size (+ 1: EOD)


def _as_flag(key: str, flat: dict):
    """``flat[key]`` as its flag gives it: NullTokenizer's vocabulary counts the end-of-document id
    that --vocab-size does not."""
    value = flat[key]
    if key == "vocab_size" and value is not None and flat.get("tokenizer_type") in NULL_TOKENIZERS:
        return value - 1
    return value


def _flag_default(key: str):
    """The default of the config field ``key`` (any section; None for one of no section, e.g. BERT's)."""
    import dataclasses
    import typing

    from ..config import Config

    hints = typing.get_type_hints(Config)
    for section in SECTIONS:
        for f in dataclasses.fields(hints[section]):
            if f.name == key:
                return f.default if f.default is not dataclasses.MISSING else None
    return None


def flag_setting(key: str, flat: dict) -> tuple[str, str]:
    """(how ``flat[key]`` reads, the words that give it) as flags on the command line: ``("--hidden-size 32",
    "--hidden-size 32")``, ``("--swiglu", "--swiglu")``, ``("no --swiglu", "")`` (the words to drop: ``fix``
    empty), ``("--no-bias-gelu-fusion", ...)``. The vocabulary is a flag only with NullTokenizer; the padded
    vocabulary is none (the vocabulary, --make-vocab-size-divisible-by and the TP size give it)."""
    value, flag = _as_flag(key, flat), "--" + key.replace("_", "-")
    if key == "padded_vocab_size":
        return f"a vocabulary padded to {value} rows", ""
    if key == "vocab_size" and flat.get("tokenizer_type") not in NULL_TOKENIZERS:
        return f"a vocabulary of {value} tokens from --tokenizer-type {flat.get('tokenizer_type')}", ""
    if isinstance(value, bool):
        if _flag_default(key) is True:  # on by default: --no-<flag> turns it off
            return (flag, flag) if value else (f"--no-{flag[2:]}", f"--no-{flag[2:]}")
        return (flag, flag) if value else (f"no {flag}", "")
    if value is None:
        return f"no {flag}", ""
    words = " ".join(shlex.quote(str(v)) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return f"{flag} {words}", f"{flag} {words}"  # quoted as typed in a shell: --pipeline-model-parallel-layout 'Et|tL'


def _differing(saved_config: dict, config, fields, shapes_only: bool) -> list[str]:
    """The keys of ``fields`` whose saved value differs from the run's (see :func:`arch_differences`)."""
    ours = config.flat()
    return [key for key in fields if key in saved_config and key in ours and saved_config[key] != ours[key]
            and not (key in DERIVED_FLAGS and saved_config[key] is None) and _changes_function(key, saved_config, ours)
            and not (shapes_only and key in SHAPE_OF and SHAPE_OF[key](saved_config[key]) == SHAPE_OF[key](ours[key]))]


def arch_differences(saved_config: dict, config, fields=ARCH_FIELDS, shapes_only: bool = False) -> list[str]:
    """``"--hidden-size 32 (this run 64)"``, ``"--swiglu (this run: no --swiglu)"`` for each of ``fields``
    whose saved value differs from the run's, named as on the command line (a derived flag saved unset is
    compared through the flags it is derived from; ``shapes_only``: the flags of :data:`SHAPE_OF` through
    the shapes their values give)."""
    ours, said = config.flat(), []
    for key in _differing(saved_config, config, fields, shapes_only):
        (saved, _), (now, _) = flag_setting(key, saved_config), flag_setting(key, ours)
        flag = "--" + key.replace("_", "-") + " "
        if saved.startswith(flag) and now.startswith(flag):
            said.append(f"{saved} (this run {now[len(flag):]})")
        elif not saved.startswith(("-", "no -")):  # the vocabulary (padded, or a tokenizer's): no flag of its own
            said.append(f"{saved} (this run {_as_flag(key, ours)})")
        else:
            said.append(f"{saved} (this run: {now})")
    return said


def arch_fix(saved_config: dict, config, fields=ARCH_FIELDS, shapes_only: bool = False) -> str:
    """What to pass for the model of ``saved_config`` where :func:`arch_differences` names a difference:
    ``"load it with --hidden-size 32 --swiglu and without --num-experts"``; the vocabulary through its
    tokenizer, the padded vocabulary through the flags that decide it."""
    ours, give, drop, other = config.flat(), [], [], []
    keys = _differing(saved_config, config, fields, shapes_only)
    for key in keys:
        if key == "padded_vocab_size":
            if "make_vocab_size_divisible_by" in keys:  # that flag's saved value is the fix
                continue
            other.append(f"pad the vocabulary to {saved_config[key]} rows (--make-vocab-size-divisible-by and "
                         f"--tensor-model-parallel-size decide the padding of the vocabulary)")
        elif key == "vocab_size" and saved_config.get("tokenizer_type") not in NULL_TOKENIZERS:
            sized = f" --vocab-size {saved_config[key]}" if saved_config.get("tokenizer_type") == "TikTokenizer" else ""
            other.append(f"use the checkpoint's tokenizer (--tokenizer-type {saved_config.get('tokenizer_type')}"
                         f"{sized} and its files)")
        else:
            words = flag_setting(key, saved_config)[1]
            if words:
                give.append(words)
            else:
                drop.append(flag_setting(key, ours)[1] or "--" + key.replace("_", "-"))
    without = f"without {' '.join(drop)}" if drop else ""
    load = f"load it with {' '.join(give)}" + (f" and {without}" if without else "") if give else \
        (f"load it {without}" if without else "")
    return "; ".join(([load] if load else []) + other)


def _changes_function(key: str, saved: dict, ours: dict) -> bool:
    """--bias-gelu-fusion changes the model only where it picks the tanh GeLU (a GeLU MLP with biases);
    --make-vocab-size-divisible-by only where it changes the padded vocabulary; --spec only where it
    names another file or object (a .py path relative to another folder, or absolute, names the same
    file: checkpoints saved before paths were stored absolute hold relative ones); --max-position-embeddings
    only with learned positions (rotary ones have no table, so a run may change --seq-length, which it
    defaults to; Megatron-LM compares it only with learned positions too)."""
    if key == "max_position_embeddings":
        return LEARNED in (saved.get("position_embedding_type", LEARNED), ours.get("position_embedding_type", LEARNED))
    if key == "make_vocab_size_divisible_by":
        return saved.get("padded_vocab_size") != ours.get("padded_vocab_size")
    if key == "spec":
        from ..models.spec import resolved

        return resolved(saved[key]) != resolved(ours[key])
    return key != "bias_gelu_fusion" or tanh_gelu(saved) != tanh_gelu(ours)


# What each kind of load compares: a resume every model flag and the vocabulary; a converted
# ``release`` checkpoint loaded by --load every model flag (a new run starts from it, e.g. with
# --mock-data, whose NullTokenizer adds an end-of-document id); a weights-only load (--finetune,
# --pretrained-checkpoint) the flags that decide shapes. The padded vocabulary always may differ
# (loading re-pads it for this run's TP size), and so may the real one where it is not compared
# (its rows are fitted: a tokenizer with added tokens gets zero rows for them).
CHECKED = {"resume": ARCHITECTURE_FLAGS + ("vocab_size",), "release": ARCHITECTURE_FLAGS, "weights": SHAPE_FLAGS}


def _family(flat: dict) -> str:
    """"BERT" for a config of pretrain_bert.py (its flags hold the "bert" section), else "GPT"."""
    return "BERT" if "bert_no_binary_head" in flat else "GPT"


def check_family(where: str, saved_config: dict, config) -> None:
    """Refuse (CheckpointError, one line) a BERT checkpoint in a GPT run or the reverse: the models share
    no tensor name (``encoder`` / ``decoder``), which was a long list of missing tensors, not the cause."""
    if not saved_config:  # a file without its flags: the tensor check says what differs
        return
    saved, ours = _family(saved_config), _family(config.flat())
    if saved != ours:
        script = {"BERT": "pretrain_bert.py", "GPT": "pretrain_gpt.py"}
        raise CheckpointError(f"checkpoint {where} holds a {saved} model ({script[saved]}), this run trains a {ours} "
                              f"({script[ours]}); load it with {script[saved]}, or give a {ours} checkpoint")


def check_architecture(where: str, saved_config: dict, config, load: str = "resume") -> None:
    """Refuse (CheckpointError, one line) a checkpoint whose model flags differ from this run's:
    those of ``CHECKED[load]``, each named as a flag with both values, and the fix: the saved values,
    --use-checkpoint-args where it takes them all, --finetune where no shape differs (a weights-only
    load compares the shapes); a checkpoint of the other model family first."""
    check_family(where, saved_config, config)
    shapes_only = load == "weights"
    arch = arch_differences(saved_config, config, CHECKED[load], shapes_only)
    if arch:
        raise CheckpointError(f"checkpoint {where} was saved with {', '.join(arch)}; "
                              f"{load_fix(saved_config, config, load, CHECKED[load])}")


def load_fix(saved_config: dict, config, load: str = "resume", fields=ARCH_FIELDS) -> str:
    """The fixes for the differences of ``fields``, joined: :func:`arch_fix`, then (not for a weights-only
    ``load``) --use-checkpoint-args where it takes every differing value, --finetune where no shape differs;
    --moe-use-upcycling for a dense checkpoint in an MoE run."""
    shapes_only = load == "weights"
    fixes = [arch_fix(saved_config, config, fields, shapes_only)]
    if load != "weights":
        keys = _differing(saved_config, config, fields, shapes_only)
        null = saved_config.get("tokenizer_type") in NULL_TOKENIZERS and config.flat().get("tokenizer_type") in NULL_TOKENIZERS
        taken = ARCHITECTURE_FLAGS + ("make_vocab_size_divisible_by", "padded_vocab_size") + (("vocab_size",) if null else ())
        if all(k in taken for k in keys):
            fixes.append("pass --use-checkpoint-args to take the model flags from the checkpoint")
        if not _differing(saved_config, config, SHAPE_FLAGS, shapes_only=True):
            fixes.append("pass --finetune to change them on purpose")
    if saved_config and not saved_config.get("num_experts") and config.flat().get("num_experts"):
        fixes.append("pass --moe-use-upcycling to make the experts from its dense MLPs")
    return ", or ".join(fixes)


def saved_config(root: str) -> tuple[str, dict]:
    """(iteration folder, flat config) of the latest checkpoint under ``root`` (either format)."""
    from .dist_read import is_dist_folder, read_common

    iteration = read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"--use-checkpoint-args: --load {root} holds no checkpoint (no {TRACKER_FILENAME}); "
                              "drop the flag or fix --load")
    folder = iteration_dir(root, iteration)
    return folder, dict(read_common(folder)["config"] if is_dist_folder(folder) else checkpoint_config(folder))


def apply_checkpoint_args(config, given: tuple[str, ...] = ()) -> list[str]:
    """Set every architecture flag of ``config`` (before it is finalized) to the value the checkpoint
    at ``--load`` was saved with; returns what changed, as ``"--hidden-size 32 (was 64)"``. ``given``:
    the command line (its words): --seq-length, which may change on a resume, is taken only when it is
    not there (Megatron-LM's rule for a flag left out)."""
    if config.checkpoint.load is None:
        raise CheckpointError("--use-checkpoint-args needs --load (the checkpoint to take the model flags from)")
    _, saved = saved_config(config.checkpoint.load)
    changed = []
    for section in SECTIONS + tuple(config.extra_sections):
        values = getattr(config, section)
        for key in ARCHITECTURE_FLAGS:
            if key in saved and hasattr(values, key) and getattr(values, key) != saved[key]:
                changed.append(_taken(key, saved[key], getattr(values, key)))
                setattr(values, key, saved[key])
    changed += _take_vocabulary(config, saved)
    m = config.model
    if saved.get("seq_length") not in (None, m.seq_length) and not any(w.split("=")[0] == "--seq-length" for w in given):
        changed.append(_taken("seq_length", saved["seq_length"], m.seq_length))
        m.seq_length = saved["seq_length"]
    # grouped key/value heads need --group-query-attention, which is no architecture flag
    if m.num_query_groups not in (None, m.num_attention_heads) and not m.group_query_attention:
        m.group_query_attention = True
        changed.append(_taken("group_query_attention", True, False))
    return changed


def _take_vocabulary(config, saved: dict) -> list[str]:
    """--use-checkpoint-args: the vocabulary's flags from the checkpoint, as ``"--vocab-size 123 (was no --vocab-size)"``:
    its --make-vocab-size-divisible-by (the padded rows are part of the saved tensors), and its
    --vocab-size where both runs use NullTokenizer (elsewhere the tokenizer's files decide it)."""
    m, changed = config.model, []
    takes = [("make_vocab_size_divisible_by", saved.get("make_vocab_size_divisible_by"))]
    if saved.get("vocab_size") is not None and config.data.tokenizer_type in NULL_TOKENIZERS and \
            saved.get("tokenizer_type") in NULL_TOKENIZERS:
        takes.append(("vocab_size", _as_flag("vocab_size", saved)))
    for key, value in takes:
        if value is not None and getattr(m, key) != value:
            changed.append(_taken(key, value, getattr(m, key)))
            setattr(m, key, value)
    return changed


def _taken(key: str, value, was) -> str:
    """A flag --use-checkpoint-args took, as on the command line (:func:`flag_setting`): ``"--hidden-size 32
    (was 64)"``, ``"--swiglu (was no --swiglu)"``; ``value`` and ``was`` are flag values (a NullTokenizer
    --vocab-size as typed)."""
    flag = "--" + key.replace("_", "-")
    if key == "vocab_size":  # flag_setting reads a saved (config) vocabulary; these are the flag's values
        now, before = (f"{flag} {v}" if v is not None else f"no {flag}" for v in (value, was))
    else:
        now, before = (flag_setting(key, {key: v})[0] for v in (value, was))
    return f"{now} (was {before[len(flag) + 1:] if before.startswith(flag + ' ') else before})"
