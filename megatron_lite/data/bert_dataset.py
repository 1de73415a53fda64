"""BERT pretraining samples from sentence-split data (one sequence per sentence).

The data is what ``preprocess_data.py --split-sentences`` writes: each sequence is a sentence and
``document_indices`` group sentences into documents.  Following Megatron-LM's BERT dataset:

* A **sample mapping** (cached like the GPT indices) lists, per sample, a run of consecutive
  sentences of one document and a target length: ``max_seq_length - 3`` (room for [CLS] and two
  [SEP]), or with probability ``short_seq_prob`` a random length in [2, max_seq_length - 3].
  Sentences are taken until the target is reached, always leaving >= 2 sentences for the next
  sample (the last sample takes the rest).  As in Megatron, documents with fewer than 2 sentences
  (1 without the binary head) are skipped, and so are documents of 2 or more sentences holding one
  longer than 512 tokens; a one-sentence document (without the binary head) is kept however long
  its sentence, and truncated like any sample.  Epochs repeat (with new target lengths) until
  ``num_samples`` are reached; the mapping is then shuffled.
* A **sample** ``[CLS] A [SEP] B [SEP]``: A = the first k sentences (k random), B = the rest;
  with probability 0.5 A and B are swapped (``is_random`` = 1, sentence-order prediction).  The
  longer segment is trimmed one token at a time from a random end down to the target length.
  Without the binary head all sentences form A: ``[CLS] A [SEP]``.
* **Masked LM**: as in Megatron, ``min(int(mask_prob * target), max(1, round(len(tokens) * mask_prob)))``
  tokens are predicted, where ``tokens`` counts the [CLS] and [SEP]s too (they are never predicted)
  and ``target`` is the sample's target length (so the cap is 0 for targets below 1 / mask_prob);
  they are chosen as whole words (a word = a token plus its "##" continuations when the tokenizer has a vocab)
  in n-grams of 1..3 words (P(n) proportional to 1/n); of the chosen tokens 80% become [MASK],
  10% a random vocabulary id, 10% stay.  labels = original id at predicted positions, -1 elsewhere.

Every sample is a deterministic function of (seed, index): its generator is
``RandomState((seed + index) % 2**32)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from megatron_lite.data.index_cache import lengths_fingerprint, load_or_build

LONG_SENTENCE_LEN = 512  # Megatron skips documents holding a longer sentence


@dataclass
class BertDatasetConfig:
    """What determines BERT samples; the training script maps its CLI flags onto these fields."""

    seq_length: int
    """--seq-length: padded length of every sample, [CLS] and [SEP]s included."""
    seed: int = 1234
    """--seed: seed of the sample mapping and of each sample's masking."""
    split: str = "969,30,1"
    """--split: train,valid,test weights over documents (normalised)."""
    data_path: list[str] = field(default_factory=list)
    """--data-path: one prefix, or 'w1 prefix1 w2 prefix2 ...' for a weighted blend."""
    per_split_data_paths: list | None = None
    """--train-data-path / --valid-data-path / --test-data-path: each split's own blend, all of its
    documents (a split without one: None); instead of --data-path and --split."""
    data_cache_path: str | None = None
    """--data-cache-path: folder for index caches (default: <data dir>/cache)."""
    mmap_bin_files: bool = True
    """--no-mmap-bin-files (False): read the .bin files with file reads instead of memory-mapping them."""
    mask_prob: float = 0.15
    """--mask-prob: fraction of the sample's tokens ([CLS]/[SEP] counted, never predicted) to predict."""
    short_seq_prob: float = 0.1
    """--short-seq-prob: probability of a shorter random target length."""
    binary_head: bool = True
    """False with --bert-no-binary-head: no sentence-order task, samples are [CLS] A [SEP]."""
    max_ngrams: int = 3
    """Longest whole-word n-gram masked at once."""
    mock: bool = False
    """--mock-data is not supported for BERT (kept for a uniform config)."""


# -- sample mapping ----------------------------------------------------------------------------------
def _mapping_one_epoch(starts: np.ndarray, counts: np.ndarray, sizes: np.ndarray, targets: np.ndarray,
                       min_sentences: int) -> np.ndarray:
    """Rows (first sentence, end sentence, target) for the documents given by sentence ranges.

    Vectorised over documents: iteration k looks at the k-th sentence of every document that has
    one (documents sorted by sentence count, so those are a prefix).  ``targets[s]`` is the target
    length of a sample that starts at sentence s.
    """
    order = np.argsort(-counts, kind="stable")
    starts, counts = starts[order], counts[order]
    group_start = starts.copy()
    seq_len = np.zeros(len(starts), dtype=np.int64)
    num_sent = np.zeros(len(starts), dtype=np.int64)
    rows = []
    for k in range(int(counts.max(initial=0))):
        a = int(np.searchsorted(-counts, -k, side="left"))  # documents with more than k sentences
        sent = starts[:a] + k
        seq_len[:a] += sizes[sent]
        num_sent[:a] += 1
        remaining = counts[:a] - k - 1
        target = targets[group_start[:a]]
        close = ((seq_len[:a] >= target) & (remaining > 1) & (num_sent[:a] >= min_sentences)) | (remaining == 0)
        idx = np.flatnonzero(close)
        rows.append(np.stack([group_start[idx], sent[idx] + 1, target[idx]], axis=1))
        group_start[idx] = sent[idx] + 1
        seq_len[idx] = 0
        num_sent[idx] = 0
    if not rows:
        return np.zeros((0, 3), dtype=np.int64)
    out = np.concatenate(rows).astype(np.int64)
    return out[np.argsort(out[:, 0], kind="stable")]


def build_bert_mapping(sizes: np.ndarray, document_indices: np.ndarray, document_ids: np.ndarray,
                       num_samples: int | None, max_seq_length: int, short_seq_prob: float, seed: int,
                       binary_head: bool = True) -> np.ndarray:
    """int64 [N, 3] rows (first sentence, end sentence, target length), shuffled, N >= num_samples."""
    max_tokens = max_seq_length - 3
    if max_tokens < 2:
        raise ValueError(f"--seq-length {max_seq_length} is too short for BERT (need >= 5)")
    sizes = np.asarray(sizes, dtype=np.int64)
    document_ids = np.asarray(document_ids, dtype=np.int64)
    starts = np.asarray(document_indices, dtype=np.int64)[document_ids]
    counts = np.asarray(document_indices, dtype=np.int64)[document_ids + 1] - starts
    min_sentences = 2 if binary_head else 1
    long_before = np.concatenate(([0], np.cumsum(sizes > LONG_SENTENCE_LEN)))  # long sentences before s
    # as in Megatron, only documents of >= 2 sentences are checked: a one-sentence document (kept
    # without the binary head) is truncated to its target length however long its sentence is
    has_long = (counts > 1) & (long_before[starts + counts] > long_before[starts])
    keep = (counts >= min_sentences) & ~has_long
    starts, counts = starts[keep], counts[keep]
    if starts.size == 0:
        hint = ", or train with --bert-no-binary-head" if binary_head else ""
        raise ValueError(f"none of its {len(document_ids)} documents has >= {min_sentences} sentences of <= "
                         f"{LONG_SENTENCE_LEN} tokens (BERT pairs sentences of a document: preprocess with "
                         f"--split-sentences, or give this split more documents with --split{hint})")
    rng = np.random.RandomState(seed)
    epochs, total = [], 0
    lo, hi = int(starts.min()), int((starts + counts).max())
    while True:
        targets = np.full(hi, max_tokens, dtype=np.int64)
        short = rng.random_sample(hi - lo) < short_seq_prob
        targets[lo:][short] = rng.randint(2, max_tokens + 1, size=int(short.sum()))
        epoch = _mapping_one_epoch(starts, counts, sizes, targets, min_sentences)
        epochs.append(epoch)
        total += len(epoch)
        if num_samples is None or total >= num_samples:
            break
    mapping = np.concatenate(epochs)
    rng.shuffle(mapping)
    return mapping


# -- one sample ---------------------------------------------------------------------------------------
def split_segments(sentences: list[np.ndarray], rng: np.random.RandomState, binary_head: bool):
    """(tokens_a, tokens_b, is_random): A = first k sentences, B = the rest, swapped with p = 0.5."""
    if not binary_head:
        return list(np.concatenate(sentences)), [], False
    a_end = rng.randint(1, len(sentences)) if len(sentences) >= 3 else 1
    tokens_a = list(np.concatenate(sentences[:a_end]))
    tokens_b = list(np.concatenate(sentences[a_end:]))
    if rng.random_sample() < 0.5:
        return tokens_b, tokens_a, True
    return tokens_a, tokens_b, False


def truncate_segments(tokens_a: list, tokens_b: list, max_tokens: int, rng: np.random.RandomState) -> bool:
    """Trim the longer segment from a random end until both fit in max_tokens; True if trimmed."""
    trimmed = False
    while len(tokens_a) + len(tokens_b) > max_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random_sample() < 0.5:
            del longer[0]
        else:
            longer.pop()
        trimmed = True
    return trimmed


def word_starts(tokens: np.ndarray, special: np.ndarray, inv_vocab) -> np.ndarray:
    """True where a token starts a word: not a "##" continuation (every token, without a vocab)."""
    starts = ~special
    if inv_vocab is not None:
        for i in np.flatnonzero(starts[1:]) + 1:
            piece = inv_vocab.get(int(tokens[i]), "") if hasattr(inv_vocab, "get") else inv_vocab[int(tokens[i])]
            if str(piece).startswith("##") and not special[i - 1]:
                starts[i] = False
    return starts


def num_to_predict(num_tokens: int, mask_prob: float, target: int) -> int:
    """Megatron's count of predicted tokens: ``mask_prob`` of all ``num_tokens`` ([CLS]/[SEP]
    included), rounded and at least 1, capped by ``mask_prob * target`` rounded down (maybe 0)."""
    return min(int(mask_prob * target), max(1, int(round(num_tokens * mask_prob))))


def mask_tokens(tokens: np.ndarray, special: np.ndarray, mask_prob: float, max_predictions: int,
                max_ngrams: int, mask_id: int, vocab_size: int, inv_vocab, rng: np.random.RandomState):
    """Whole-word n-gram masking of up to ``max_predictions`` non-special tokens; returns
    (masked tokens, predicted positions sorted, original ids)."""
    if mask_prob <= 0 or max_predictions <= 0 or not (~special).any():
        return tokens, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    is_start = word_starts(tokens, special, inv_vocab)
    word_begin = np.flatnonzero(is_start)
    # a word runs from its start to just before the next word start or special token
    boundaries = np.flatnonzero(is_start | special)
    word_end = np.append(boundaries, len(tokens))[np.searchsorted(boundaries, word_begin, side="right")]
    words = [list(range(b, e)) for b, e in zip(word_begin, word_end)]
    ngram_p = 1.0 / np.arange(1, max_ngrams + 1)
    order = rng.permutation(len(words))
    out = tokens.copy()
    chosen: list[int] = []
    covered = np.zeros(len(tokens), dtype=bool)
    for w in order:
        if len(chosen) >= max_predictions:
            break
        longest = min(max_ngrams, len(words) - w)
        p = ngram_p[:longest] / ngram_p[:longest].sum()
        n = int(rng.choice(np.arange(1, longest + 1), p=p))
        span = sum(words[w:w + n], [])
        while len(chosen) + len(span) > max_predictions and n > 1:  # shorter n-grams if too many
            n -= 1
            span = sum(words[w:w + n], [])
        if len(chosen) + len(span) > max_predictions or covered[span].any():
            continue
        covered[span] = True
        for i in span:
            if rng.random_sample() < 0.8:
                out[i] = mask_id
            elif rng.random_sample() >= 0.5:
                out[i] = rng.randint(0, vocab_size)
            chosen.append(i)
    positions = np.array(sorted(chosen), dtype=np.int64)
    return out, positions, tokens[positions]


class BertDataset:
    """Masked-LM (+ sentence-order) samples of one split; ``ds[i]`` is a dict of numpy arrays:
    text, types, labels, is_random, loss_mask, padding_mask, truncated.

    ``tokenizer`` must provide cls, sep, mask, pad and vocab_size; with ``inv_vocab`` (id -> piece)
    masking keeps "##" word pieces together.
    """

    def __init__(self, indexed_dataset, document_ids, num_samples: int | None, config: BertDatasetConfig,
                 tokenizer, split_name: str = "train", cache_dir: str | None = None):
        self.dataset = indexed_dataset
        self.config = config
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        if self.document_ids.size == 0:
            raise ValueError(f"{split_name} split has no documents (--split {config.split!r})")
        if tokenizer is None or any(getattr(tokenizer, a, None) is None for a in ("cls", "sep", "mask", "pad")):
            raise ValueError("BERT data needs a WordPiece tokenizer with [CLS]/[SEP]/[MASK]/[PAD] "
                             "(--tokenizer-type BertWordPieceLowerCase --vocab-file ...)")
        self.cls, self.sep, self.mask, self.pad = (int(tokenizer.cls), int(tokenizer.sep), int(tokenizer.mask),
                                                   int(tokenizer.pad))
        self.vocab_size = int(tokenizer.vocab_size)
        self.inv_vocab = getattr(tokenizer, "inv_vocab", None)
        prefix = getattr(indexed_dataset, "path_prefix", None)
        self.description = {
            "class": type(self).__name__,
            "path_prefix": os.path.abspath(prefix) if prefix else None,
            "num_sequences": int(len(indexed_dataset.sequence_lengths)),
            "sequence_lengths_sha1": lengths_fingerprint(indexed_dataset.sequence_lengths),
            # the samples pair sentences of one document: the grouping is part of the mapping's identity
            "document_indices_sha1": lengths_fingerprint(indexed_dataset.document_indices),
            "split": split_name,
            "document_range": [int(self.document_ids[0]), int(self.document_ids[-1]) + 1],
            "num_samples": num_samples,
            "seq_length": config.seq_length,
            "short_seq_prob": config.short_seq_prob,
            "binary_head": config.binary_head,
            "seed": config.seed,
        }
        arrays, self.index_source = load_or_build(
            cache_dir if cache_dir is not None else config.data_cache_path, self.description, ["samples_mapping"],
            lambda: {"samples_mapping": build_bert_mapping(
                indexed_dataset.sequence_lengths, indexed_dataset.document_indices, self.document_ids,
                num_samples, config.seq_length, config.short_seq_prob, config.seed, config.binary_head)})
        self.samples_mapping = arrays["samples_mapping"]

    def __len__(self) -> int:
        return self.samples_mapping.shape[0]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        cfg = self.config
        first, end, target = (int(v) for v in self.samples_mapping[idx])
        rng = np.random.RandomState((cfg.seed + int(idx)) % 2**32)
        sentences = [np.asarray(self.dataset[i], dtype=np.int64) for i in range(first, end)]
        tokens_a, tokens_b, is_random = split_segments(sentences, rng, cfg.binary_head)
        truncated = truncate_segments(tokens_a, tokens_b, target, rng)
        parts = [[self.cls], tokens_a, [self.sep]] + ([tokens_b, [self.sep]] if tokens_b else [])
        tokens = np.array(sum(parts, []), dtype=np.int64)
        types = np.zeros(len(tokens), dtype=np.int64)
        types[len(tokens_a) + 2:] = 1
        special = (tokens == self.cls) | (tokens == self.sep)
        special[[0, len(tokens_a) + 1]] = True
        if tokens_b:
            special[-1] = True
        max_predictions = num_to_predict(len(tokens), cfg.mask_prob, target)
        masked, positions, originals = mask_tokens(tokens, special, cfg.mask_prob, max_predictions,
                                                   cfg.max_ngrams, self.mask, self.vocab_size, self.inv_vocab, rng)
        n, s = len(tokens), cfg.seq_length
        out = {
            "text": np.full(s, self.pad, dtype=np.int64),
            "types": np.zeros(s, dtype=np.int64),
            "labels": np.full(s, -1, dtype=np.int64),
            "is_random": np.int64(is_random),
            "loss_mask": np.zeros(s, dtype=np.int64),
            "padding_mask": np.zeros(s, dtype=np.int64),
            "truncated": np.int64(truncated),
        }
        out["text"][:n] = masked
        out["types"][:n] = types
        out["labels"][positions] = originals
        out["loss_mask"][positions] = 1
        out["padding_mask"][:n] = 1
        return out
