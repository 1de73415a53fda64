"""Train / valid / test datasets from Megatron-style data flags.

    train, valid, test = build_train_valid_test_datasets(config, [n_train, n_valid, n_test], tokenizer)

``config`` is a ``GPTDatasetConfig`` (or ``BertDatasetConfig``).  ``--data-path`` is one prefix or a
weighted blend ``w1 p1 w2 p2 ...``; ``--split 949,50,1`` cuts each dataset's documents into three
contiguous ranges (Megatron's rounding).  ``--train-data-path`` / ``--valid-data-path`` /
``--test-data-path`` (``per_split_data_paths``) give each split a blend of its own instead, every
document of it.  ``--mock-data`` needs no files.  A split whose weight is 0, whose path is not given,
or whose requested sample count is 0 gives None.  User errors (missing file, bad weights, a split
left without documents) raise ``DataConfigError`` / ``DataFileError`` with one line naming the flag.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import NamedTuple

import numpy as np

from megatron_lite.data.blended import BlendedDataset, normalize_weights, samples_per_dataset
from megatron_lite.data.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDataset

log = logging.getLogger(__name__)
SPLIT_NAMES = ("train", "valid", "test")


class DataConfigError(ValueError):
    """A data flag (--data-path, --split, ...) is malformed or does not fit the data."""


def _split_weight(field: str) -> float | None:
    try:
        value = float(field)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def parse_split(split: str) -> list[float]:
    """'949,50,1' (or '949/50/1', or fewer numbers, padded with 0) -> 3 weights summing to 1.

    Every field must be a number: '98,2,x' or '1,,2' is refused, not read as 98,2,0 or 1,2,0 (picking
    the numbers out of the string, as Megatron-LM does, gives a test split the user did not ask for)."""
    text = str(split).strip()
    fields = [f.strip() for f in re.split(r"[,/]", text)] if text else []
    values = [_split_weight(f) for f in fields]
    if not values or len(values) > 3 or None in values or sum(values) <= 0:
        raise DataConfigError(f"--split {split!r}: expected up to 3 non-negative weights separated by commas, "
                              f"like 949,50,1")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def split_ranges(num_documents: int, weights: list[float]) -> list[tuple[int, int]]:
    """Megatron's rounding: cumulative round(weight * n), then all bounds shifted so the last is n."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [0] + [b - excess for b in bounds[1:]]
    return [(max(0, bounds[i]), max(0, bounds[i + 1])) for i in range(len(weights))]


def _names_data(item: str) -> bool:
    """Does ``item`` name a dataset as it stands (a .bin/.idx prefix or a file), spaces and all?"""
    return os.path.isfile(item + ".idx") or os.path.isfile(item)


def parse_data_path(data_path, flag: str = "--data-path") -> tuple[list[str], list[float] | None]:
    """``prefix`` | ``w1 p1 w2 p2 ...`` | ``p1 p2 ...`` -> (prefixes, normalised weights or None).

    An entry holding spaces is split into words (``"0.3 web 0.7 books"`` from a config file), unless
    it names an existing dataset as it is (a path with a space in it). ``flag`` is named in errors."""
    entries = [data_path] if isinstance(data_path, str) else [str(x) for x in data_path]
    items = [w for x in entries for w in ([x] if x.strip() and _names_data(x) else x.split())]
    if not items:
        raise DataConfigError(f"{flag} is empty: give a dataset prefix, 'w1 prefix1 w2 prefix2 ...', "
                              "or use --mock-data")
    if len(items) == 1:
        return items, None

    def number(s):
        try:
            return float(s)
        except ValueError:
            return None

    firsts = [number(s) for s in items[0::2]]
    if len(items) % 2 == 1 or any(v is None for v in firsts):
        if any(number(s) is not None for s in items):
            raise DataConfigError(f"{flag} {' '.join(items)!r}: expected 'w1 prefix1 w2 prefix2 ...' "
                                  f"(a weight before every prefix) or prefixes only")
        return items, None
    try:
        weights = normalize_weights(firsts)
    except ValueError as err:
        raise DataConfigError(f"{flag}: {err}") from None
    return items[1::2], [float(w) for w in weights]


def default_cache_dir(config, prefix: str | None) -> str | None:
    """--data-cache-path, else <folder of the data>/cache if writable, else None (build in memory)."""
    if getattr(config, "data_cache_path", None):
        return config.data_cache_path
    if prefix is None:
        return None
    folder = os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")
    parent = os.path.dirname(folder)
    if os.access(folder if os.path.isdir(folder) else parent, os.W_OK):
        return folder
    log.warning("data folder %s is not writable and no --data-cache-path given: building indices in memory",
                parent)
    return None


def _is_bert(config) -> bool:
    return type(config).__name__ == "BertDatasetConfig"


def _open(prefix: str, mmap_bin: bool = True, flag: str = "--data-path", used: bool = True) -> IndexedDataset:
    """The dataset at ``prefix``; one that is ``used`` (weight above 0) must hold integer tokens."""
    try:
        dataset = IndexedDataset(prefix, mmap_bin)
    except DataFileError as err:
        raise DataFileError(f"{flag}: {err}") from None
    if used and dataset.dtype.kind == "f":  # Megatron's format allows floats (not token ids): the samples would truncate them
        raise DataFileError(f"{flag}: {prefix}.idx: its dtype is {dataset.dtype.name}, which holds no token ids; "
                            f"give a dataset written by tools/preprocess_data.py (integer tokens)")
    return dataset


def _num_units(config, indexed) -> int:
    """What --split divides: documents for BERT, sequences for GPT."""
    return indexed.num_documents() if _is_bert(config) else len(indexed)


def _split_document_ids(config, indexed) -> list[np.ndarray | None]:
    """Per split, the ids of its documents (sequences for GPT, documents for BERT); None if weight 0."""
    weights = parse_split(config.split)
    n = _num_units(config, indexed)
    return [None if w == 0 else np.arange(lo, hi) for w, (lo, hi) in zip(weights, split_ranges(n, weights))]


class _Source(NamedTuple):
    """One split's data: the flag that gave it, its datasets, their blend weights (None: one dataset),
    and the document ids each dataset gives the split."""

    flag: str
    prefixes: list[str]
    weights: list[float] | None
    indexed: list
    ids: list[np.ndarray]

    def where(self, prefix: str, name: str, config) -> str:
        """How an error names split ``name`` of this data: the flag, the prefix and, for --data-path, the --split."""
        return f"{self.flag} {prefix}, {name} split" + (f" (--split {config.split})" if self.flag == "--data-path" else "")


def _open_blend(config, data_path, flag: str) -> tuple[list[str], list[float] | None, list]:
    """(prefixes, weights, opened datasets) of a --data-path-style blend."""
    prefixes, weights = parse_data_path(data_path, flag)
    indexed = [_open(p, config.mmap_bin_files, flag, used=weights is None or w > 0)
               for p, w in zip(prefixes, weights or [None] * len(prefixes))]
    if weights is None and len(prefixes) > 1:  # prefixes only: weight by token count (Megatron-LM concatenates each once instead)
        weights = [float(np.sum(d.sequence_lengths, dtype=np.int64)) for d in indexed]
        weights = [float(w) for w in normalize_weights(weights)]
    return prefixes, weights, indexed


def _sources(config) -> list[_Source | None]:
    """Per split (train, valid, test) its data, or None for a split that has none (weight 0 in --split,
    or its per-split path not given)."""
    per_split = getattr(config, "per_split_data_paths", None)
    if per_split:
        out = []
        for name, paths in zip(SPLIT_NAMES, per_split):
            flag = f"--{name}-data-path"
            blend = _open_blend(config, paths, flag) if paths else None
            out.append(None if blend is None else _Source(flag, *blend, [np.arange(_num_units(config, d))
                                                                        for d in blend[2]]))
        return out
    prefixes, weights, indexed = _open_blend(config, config.data_path, "--data-path")
    ids = [_split_document_ids(config, d) for d in indexed]
    return [None if ids[0][s] is None else _Source("--data-path", prefixes, weights, indexed, [i[s] for i in ids])
            for s in range(len(SPLIT_NAMES))]


def _check_not_empty(config, ids: np.ndarray, indexed, prefix: str, name: str, source: _Source) -> None:
    if ids.size == 0 and _num_units(config, indexed) == 0:  # no --split could help: the data itself is empty
        docs = indexed.num_documents()
        what = f"holds no tokens: its {docs} documents are all empty" if docs else "has no documents"
        raise DataConfigError(f"{source.flag} {prefix} {what}; give a dataset with some text (empty texts, or a "
                              "tools/preprocess_data.py --json-keys naming an empty field, write none)")
    if ids.size == 0:
        if source.flag != "--data-path":
            raise DataConfigError(f"{source.flag} {prefix} has no documents; give a dataset with some")
        raise DataConfigError(f"--split {config.split}: the {name} split of {prefix} gets none of its "
                              f"{_num_units(config, indexed)} documents; use more data or change --split")


def _make(config, indexed, doc_ids, num_samples, split_name, tokenizer, cache_dir, source: _Source):
    """The split's dataset; what its documents cannot give (BERT: no document with 2 sentences, a too
    short --seq-length) is a DataConfigError naming the data and the split, not a traceback."""
    try:
        if _is_bert(config):
            from megatron_lite.data.bert_dataset import BertDataset

            return BertDataset(indexed, doc_ids, num_samples, config, tokenizer, split_name, cache_dir)
        return GPTDataset(indexed, doc_ids, num_samples, config, split_name, cache_dir)
    except (DataFileError, DataConfigError):
        raise
    except ValueError as err:
        raise DataConfigError(f"{source.where(getattr(indexed, 'path_prefix', '?'), split_name, config)}: {err}") from None


class ZeroWeightMember:
    """The place of a weight-0 member in a blend (which never draws from it): no samples, nothing built."""

    def __init__(self, prefix: str, split_name: str):
        self.description = {"class": "Unused", "path_prefix": prefix, "split": split_name}

    def __len__(self) -> int:
        return 0

    def __getitem__(self, idx):
        raise IndexError(f"{self.description['path_prefix']} has weight 0 in the blend: it gives no samples")


def _with_tokenizer(config, tokenizer):
    """Fill the EOD id / vocab size from the tokenizer when the config leaves them unset."""
    if tokenizer is not None and not _is_bert(config):
        if config.eod is None and getattr(tokenizer, "eod", None) is not None:
            config.eod = int(tokenizer.eod)
        if getattr(tokenizer, "vocab_size", None):
            config.vocab_size = int(tokenizer.vocab_size)
    return config


def _build_split(config, source: _Source, name: str, n, tokenizer):
    """One split's dataset: one dataset's samples, or a blend of its datasets' (exactly ``n`` samples).
    A member of weight 0 gives no samples (the blend never draws it), so its split is neither checked
    nor built: a tiny or unusual dataset switched off by weight 0 cannot refuse the run."""
    prefixes, weights = source.prefixes, source.weights
    used = [True] * len(prefixes) if weights is None else [w > 0 for w in weights]
    for d, ids, p, on in zip(source.indexed, source.ids, prefixes, used):
        if on:
            _check_not_empty(config, ids, d, p, name, source)
    if len(prefixes) == 1:
        return _make(config, source.indexed[0], source.ids[0], n, name, tokenizer,
                     default_cache_dir(config, prefixes[0]), source)
    sizes = samples_per_dataset(weights, n) if n is not None else [None] * len(prefixes)
    parts = [_make(config, d, ids, k, name, tokenizer, default_cache_dir(config, p), source) if on
             else ZeroWeightMember(p, name) for d, ids, k, p, on in zip(source.indexed, source.ids, sizes, prefixes, used)]
    if n is None:  # one epoch of each: as many samples as the blend can draw without running out
        n = int(min(len(p) / w for p, w in zip(parts, weights) if w > 0))
    return BlendedDataset(parts, weights, n, default_cache_dir(config, prefixes[0]), name)


def build_train_valid_test_datasets(config: GPTDatasetConfig, train_valid_test_num_samples,
                                    tokenizer=None) -> tuple:
    """(train, valid, test) datasets; None for a split with weight 0, no path, or 0 requested samples.

    ``train_valid_test_num_samples``: samples each split must provide (None = one epoch of a
    single dataset).  Blended splits are exactly that size; each part is built for
    ``ceil(weight * n * 1.005)`` samples, as in Megatron.
    """
    config = _with_tokenizer(config, tokenizer)
    eod_flags = [f for f, on in (("--eod-mask-loss", getattr(config, "eod_mask_loss", False)),
                                 ("--reset-position-ids", getattr(config, "reset_position_ids", False)),
                                 ("--reset-attention-mask", getattr(config, "reset_attention_mask", False))) if on]
    if eod_flags and getattr(config, "eod", 0) is None:
        raise DataConfigError(f"{', '.join(eod_flags)} need an end-of-document token, and this tokenizer has none; "
                              "drop the flag(s) or use a tokenizer with an EOD")
    nums = list(train_valid_test_num_samples) + [None] * (3 - len(train_valid_test_num_samples))
    if config.mock:
        if _is_bert(config):
            raise DataConfigError("--mock-data is only supported for GPT; give BERT a --data-path")
        return tuple(None if not n else MockGPTDataset(n, config, name) for n, name in zip(nums, SPLIT_NAMES))
    sources = _sources(config)
    if sources[0] is None and nums[0]:  # training needs train samples: refuse, not a None iterator later
        if getattr(config, "per_split_data_paths", None):
            raise DataConfigError(f"training needs {nums[0]} train samples; give --train-data-path")
        raise DataConfigError(f"--split {config.split} gives the train split weight 0, but training needs "
                              f"{nums[0]} train samples; give it a weight (e.g. --split 98,2,0)")
    out = [None if source is None or n == 0 else _build_split(config, source, name, n, tokenizer)
           for name, n, source in zip(SPLIT_NAMES, nums, sources)]
    for name, ds in zip(SPLIT_NAMES, out):
        if ds is not None:
            log.info("%s dataset: %d samples (%s)", name, len(ds), type(ds).__name__)
    return tuple(out)


def build_validation_sets(config: GPTDatasetConfig, num_samples: int | None, tokenizer=None) -> list:
    """--multiple-validation-sets: the validation split's datasets, each built on its own (``num_samples``
    each; None: one epoch of each), in the order --valid-data-path (or --data-path) lists them."""
    config = _with_tokenizer(config, tokenizer)
    source = _sources(config)[1]
    if source is None:
        raise DataConfigError("--multiple-validation-sets: the validation split has no data; give --valid-data-path "
                              "or a --split whose validation weight is above 0")
    return [_build_split(config, _Source(source.flag, [p], None, [d], [ids]), "valid", num_samples, tokenizer)
            for p, d, ids in zip(source.prefixes, source.indexed, source.ids)]


def train_valid_test_num_samples(train_iters: int, global_batch_size: int, eval_interval: int,
                                 eval_iters: int, train_samples: int | None = None,
                                 valid_samples: int | None = None, eval_global_batch_size: int | None = None) -> list[int]:
    """Samples each split must provide, as Megatron computes them: validation runs eval_iters
    iterations (of ``eval_global_batch_size`` samples, default ``global_batch_size``) every eval_interval
    iterations and once at the end; test runs eval_iters once.
    ``valid_samples`` (a resumed run's need: :func:`~megatron_lite.training.batch_rampup.valid_config_for_resume`)
    replaces the validation count."""
    train = train_samples if train_samples is not None else train_iters * global_batch_size
    evals = (train_iters // eval_interval + 1) * eval_iters if eval_interval else 0
    eval_batch = global_batch_size if eval_global_batch_size is None else eval_global_batch_size
    valid = evals * eval_batch if valid_samples is None else valid_samples
    return [train, valid, eval_iters * eval_batch]


def consumed_valid_samples(iteration: int, global_batch_size: int, eval_interval: int, eval_iters: int) -> int:
    """Validation samples a run has read by ``iteration`` (Megatron's rule): eval_iters global batches
    every eval_interval iterations; a resumed run's validation continues from there."""
    if eval_iters <= 0 or not eval_interval:
        return 0
    return (iteration // eval_interval) * eval_iters * global_batch_size


def per_split_data_paths(values: dict) -> list | None:
    """[--train-data-path, --valid-data-path, --test-data-path] (a missing one None), or None when none is given."""
    paths = [list(values[f"{name}_data_path"]) if values.get(f"{name}_data_path") else None for name in SPLIT_NAMES]
    return paths if any(paths) else None


def given_data_paths(values: dict) -> list[tuple[str, list[str]]]:
    """(flag, its values) of each data path a run gives: --data-path, or the per-split paths given."""
    if values.get("data_path"):
        return [("--data-path", list(values["data_path"]))]
    return [(f"--{name}-data-path", list(values[f"{name}_data_path"])) for name in SPLIT_NAMES
            if values.get(f"{name}_data_path")]


def data_flags(values: dict) -> str:
    """The data flags of a run as a user typed them, for messages: '--data-path ...' or the per-split paths."""
    return " ".join(f"{flag} {' '.join(paths)}" for flag, paths in given_data_paths(values)) or "--data-path"


def dataset_config_from_args(args, tokenizer=None, bert: bool = False):
    """GPTDatasetConfig (or BertDatasetConfig) from flag values with Megatron's names: an argparse
    namespace or a flat dict such as ``Config.flat()``.

    Reads seq_length, seed, split, data_path, train/valid/test_data_path, data_cache_path, mock_data, eod_mask_loss,
    reset_position_ids, reset_attention_mask (GPT) or mask_prob, short_seq_prob,
    bert_no_binary_head (BERT); missing ones keep the dataclass defaults.
    """
    values = args if isinstance(args, dict) else vars(args)

    def get(name, default=None):
        value = values.get(name)
        return default if value is None else value

    common = dict(seq_length=int(values["seq_length"]), seed=int(get("seed", 1234)), split=str(get("split", "969,30,1")),
                  data_path=list(get("data_path", [])), data_cache_path=get("data_cache_path"),
                  mock=bool(get("mock_data", False)), mmap_bin_files=bool(get("mmap_bin_files", True)),
                  per_split_data_paths=per_split_data_paths(values))
    if bert:
        from megatron_lite.data.bert_dataset import BertDatasetConfig

        return BertDatasetConfig(**common, mask_prob=float(get("mask_prob", 0.15)),
                                 short_seq_prob=float(get("short_seq_prob", 0.1)),
                                 binary_head=not bool(get("bert_no_binary_head", False)))
    config = GPTDatasetConfig(**common, eod_mask_loss=bool(get("eod_mask_loss", False)),
                              reset_position_ids=bool(get("reset_position_ids", False)),
                              reset_attention_mask=bool(get("reset_attention_mask", False)))
    return _with_tokenizer(config, tokenizer)
