"""Supervised fine-tuning samples (``--sft``): chat conversations, padded or packed.

Every sample is ``seq_length + 1`` tokens ``x``: ``tokens = x[:-1]``, ``labels = x[1:]``, and the
loss counts label ``x[i + 1]`` when that token is learned (assistant text, end of turn, the EOD
after the conversation: :mod:`~megatron_lite.data.chat_template`) and belongs to the same
conversation as ``x[i]``. As in Megatron, the loss never sees system or user tokens, padding, or
a prediction across two conversations.

* Padding (default, Megatron's SFT dataset): one conversation per sample, then the tokenizer's pad
  token (EOD when it has none) to the end; positions ``0..s-1``. The padding comes after every real
  token, so plain causal attention never lets a real token see it.
* Packing (``--sft-pack-sequences``): consecutive conversations of a shuffled epoch go into one
  sample while they fit (next-fit: a conversation that does not fit starts the next sample), then
  padding. Positions restart at 0 with every conversation, and the sample carries
  ``document_ids`` (one id per conversation, another for the padding): attention stays inside
  each conversation (:mod:`~megatron_lite.parallel.document_mask`), also under context parallelism
  and on the flash-attn path. So a packed sample's loss is exactly the sum of its conversations'.

A conversation longer than ``seq_length + 1`` tokens is refused with its ``file:line`` (or
skipped with ``--sft-skip-bad-conversations``), never truncated. Conversations are split into
train/valid/test by ``--split`` (contiguous ranges, as documents in pretraining); each epoch is a
fresh permutation from ``--seed``, and epochs are added until the run's samples are there. Several
``--data-path`` entries (with weights, a blend) are blended as in pretraining.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from megatron_lite.data.blended import BlendedDataset, normalize_weights, samples_per_dataset
from megatron_lite.data.builder import (
    SPLIT_NAMES,
    DataConfigError,
    ZeroWeightMember,
    parse_data_path,
    parse_split,
    split_ranges,
)
from megatron_lite.data.indexed_dataset import DataFileError
from megatron_lite.data.sft_conversations import SKIP_FLAG, Conversations, is_indexed, read_conversations
from megatron_lite.errors import ConfigError


@dataclass
class SFTDatasetConfig:
    seq_length: int
    """--seq-length: tokens per sample fed to the model (each sample reads seq_length + 1)."""
    data_path: list[str] = field(default_factory=list)
    """--data-path: JSONL files or preprocessed prefixes (optionally weighted: 'w1 p1 w2 p2')."""
    seed: int = 1234
    """--seed: seed of the conversation shuffles."""
    split: str = "969,30,1"
    """--split: train,valid,test weights over the conversations of each file."""
    pack: bool = False
    """--sft-pack-sequences: several conversations per sample."""
    skip_bad: bool = False
    """--sft-skip-bad-conversations: count and skip bad conversations instead of stopping."""
    eod: int | None = None
    """The tokenizer's end-of-document id."""
    pad: int | None = None
    """The padding id (the tokenizer's pad, else EOD)."""
    mmap_bin_files: bool = True
    """--no-mmap-bin-files (False): read preprocessed .bin files with file reads instead of memory-mapping them."""


def check_sft_flags(config) -> None:
    """The flag combinations ``--sft`` cannot take (ConfigError, one line)."""
    d = config.data
    if not d.sft:
        for flag, on in (("--sft-pack-sequences", d.sft_pack_sequences),
                         ("--sft-skip-bad-conversations", d.sft_skip_bad_conversations)):
            if on:
                raise ConfigError(f"{flag} needs --sft")
        return
    if "bert" in config.extra_sections:
        raise ConfigError("--sft is for pretrain_gpt.py (chat data for a GPT model), not pretrain_bert.py")
    if d.mock_data or d.tokenizer_type in (None, "NullTokenizer"):
        raise ConfigError("--sft reads chat conversations from --data-path and needs a text tokenizer "
                          "(--tokenizer-type and its files), not --mock-data or NullTokenizer")
    ltor = [f for f, on in (("--eod-mask-loss", d.eod_mask_loss), ("--reset-position-ids", d.reset_position_ids),
                            ("--reset-attention-mask", d.reset_attention_mask)) if on]
    if ltor:
        raise ConfigError(f"--sft builds its own loss mask, positions and attention: drop {', '.join(ltor)} "
                          "(--sft-pack-sequences resets positions and attention per conversation)")


# ---------------------------------------------------------------------------------------------
# Which conversations make each sample.


def _next_fit(lengths: np.ndarray, capacity: int) -> list[int]:
    """How many consecutive conversations go into each sample (next-fit into ``capacity`` tokens)."""
    counts, used, n = [], 0, 0
    for length in lengths.tolist():
        if n and used + length > capacity:
            counts.append(n)
            used, n = 0, 0
        used, n = used + length, n + 1
    if n:
        counts.append(n)
    return counts


def build_sample_index(lengths, conversation_ids, num_samples: int | None, capacity: int, pack: bool,
                       seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds): sample ``i`` is conversations ``order[bounds[i]:bounds[i + 1]]``.

    Epochs (each a permutation of ``conversation_ids`` from one seeded generator) are added until
    there are ``num_samples`` samples (one epoch when None); a sample never spans two epochs."""
    lengths, ids = np.asarray(lengths), np.asarray(conversation_ids, dtype=np.int64)
    rng = np.random.RandomState(seed)
    orders, counts = [], []
    while True:
        order = rng.permutation(ids)
        orders.append(order)
        counts += _next_fit(lengths[order], capacity) if pack else [1] * len(order)
        if num_samples is None or len(counts) >= num_samples:
            break
    return np.concatenate(orders), np.concatenate(([0], np.cumsum(counts))).astype(np.int64)


def make_sample(parts, seq_length: int, pad: int, pack: bool) -> dict[str, np.ndarray]:
    """The sample of the conversations ``parts`` (``(tokens, trained)`` each), padded to ``seq_length + 1``."""
    n = seq_length + 1
    x = np.full(n, pad, dtype=np.int64)
    trained = np.zeros(n, dtype=bool)
    document = np.full(n, len(parts), dtype=np.int64)  # the padding is one more document
    position = np.zeros(n, dtype=np.int64)
    at = 0
    for d, (tokens, learn) in enumerate(parts):
        m = len(tokens)
        x[at:at + m], trained[at:at + m], document[at:at + m] = tokens, learn, d
        position[at:at + m] = np.arange(m)
        at += m
    position[at:] = np.arange(n - at)
    loss_mask = trained[1:] & (document[1:] == document[:-1])
    sample = {"tokens": x[:-1], "labels": x[1:], "loss_mask": loss_mask.astype(np.float32),
              "position_ids": position[:-1]}
    if pack:
        sample["document_ids"] = document[:-1]
    return sample


class SFTDataset:
    """The samples of one split of one conversation file; ``ds[i]`` is a dict of numpy arrays."""

    def __init__(self, conversations: Conversations, conversation_ids, num_samples: int | None,
                 config: SFTDatasetConfig, split_name: str = "train"):
        self.conversations, self.config = conversations, config
        if len(conversation_ids) == 0:
            raise DataConfigError(f"--split {config.split}: the {split_name} split of {conversations.source} gets "
                                  f"none of its {len(conversations)} conversations; use more data or change --split")
        self.order, self.bounds = build_sample_index(conversations.lengths, conversation_ids, num_samples,
                                                     config.seq_length + 1, config.pack, config.seed)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"SFT sample {idx} out of range [0, {len(self)})")
        chosen = self.order[self.bounds[idx]:self.bounds[idx + 1]]
        parts = [self.conversations.get(int(c)) for c in chosen]
        return make_sample(parts, self.config.seq_length, self.config.pad, self.config.pack)


# ---------------------------------------------------------------------------------------------
# Building the splits.


def sft_config_from(config, tokenizer) -> SFTDatasetConfig:
    """The SFTDatasetConfig of a run's :class:`~megatron_lite.config.Config` and tokenizer."""
    d = config.data
    eod = getattr(tokenizer, "eod", None)
    if eod is None:
        raise DataConfigError("--sft needs a tokenizer with an end-of-document token (it ends every conversation)")
    pad = getattr(tokenizer, "pad", None)
    return SFTDatasetConfig(seq_length=config.model.seq_length, data_path=list(d.data_path or []),
                            seed=config.training.seed, split=d.split, pack=d.sft_pack_sequences,
                            skip_bad=d.sft_skip_bad_conversations, eod=int(eod), pad=int(eod if pad is None else pad),
                            mmap_bin_files=d.mmap_bin_files)


def _skip_report(conversations: Conversations) -> str | None:
    total = sum(conversations.skipped.values())
    if not total:
        return None
    reasons = ", ".join(f"{n} {reason}" for reason, n in conversations.skipped.most_common())
    return (f"WARNING: {SKIP_FLAG}: skipped {total} of {total + len(conversations)} conversations in "
            f"{conversations.source} ({reasons})")


def read_sft_data(config: SFTDatasetConfig, tokenizer, say=print) -> tuple:
    """(paths, weights, conversations of each path) of --data-path, read and tokenized once (None for a
    weight-0 path, never read); ``say`` prints the skipped-conversation counts (once per file)."""
    paths, weights = parse_data_path(config.data_path)
    used = [True] * len(paths) if weights is None else [w > 0 for w in weights]  # weight 0: never drawn, not read
    for p, on in zip(paths, used):
        if not (on or os.path.isfile(p) or is_indexed(p)):
            raise DataFileError(f"{p}: file not found (--data-path)")
    sets = [read_conversations(p, tokenizer, config.seq_length + 1, config.skip_bad, config.mmap_bin_files) if on
            else None for p, on in zip(paths, used)]
    for conversations in (c for c in sets if c is not None):
        if len(conversations) == 0:
            raise DataConfigError(f"--data-path {conversations.source}: no conversations"
                                  + (" left after skipping bad ones" if conversations.skipped else ""))
        report = _skip_report(conversations)
        if report:
            say(report)
    if weights is None and len(sets) > 1:  # several files without weights: by conversation count
        weights = [float(w) for w in normalize_weights([len(c) for c in sets])]
    return paths, weights, sets


def build_sft_datasets(config: SFTDatasetConfig, train_valid_test_num_samples, tokenizer, say=print,
                       data: tuple | None = None) -> tuple:
    """(train, valid, test) SFT datasets; None for a split with weight 0 or 0 requested samples.
    ``data``: :func:`read_sft_data`'s result (read here when None, ``say`` printing its skip counts), so a
    run building its test split apart from the others reads the files once."""
    paths, weights, sets = read_sft_data(config, tokenizer, say) if data is None else data
    split = parse_split(config.split)
    ranges = [split_ranges(len(c), split) if c is not None else None for c in sets]
    out = []
    for s, (name, n) in enumerate(zip(SPLIT_NAMES, list(train_valid_test_num_samples) + [None] * 3)):
        if split[s] == 0 or n == 0:
            out.append(None)
            continue
        counts = samples_per_dataset(weights, n) if len(sets) > 1 and n is not None else [n] * len(sets)
        parts = [SFTDataset(c, np.arange(*r[s]), k, config, name) if c is not None else ZeroWeightMember(p, name)
                 for c, r, k, p in zip(sets, ranges, counts, paths)]
        if len(parts) == 1:
            out.append(parts[0])
            continue
        if n is None:
            n = int(min(len(p) / w for p, w in zip(parts, weights) if w > 0))
        out.append(BlendedDataset(parts, weights, n, None, name))
    return tuple(out)
