"""GPT pretraining samples cut from a token dataset, with Megatron's index arrays.

A GPT sample is ``seq_length + 1`` consecutive tokens of the shuffled token stream of one split:
``tokens = x[:-1]`` and ``labels = x[1:]``.  Three index arrays, identical to Megatron-LM's for the
same data, seed and flags, say where every sample lives:

* ``document_index`` (int32 [E*D], int64 past 2^31 sequences): the split's document ids tiled over E epochs and shuffled
  with ``numpy.random.RandomState(seed)``.  If the last epoch would supply fewer than 80% of an
  epoch's samples, the first E-1 epochs are shuffled together and the last epoch separately, then
  appended, so the partial last epoch is still a uniform draw over documents.
* ``sample_index`` (int [N+1, 2]): row i = (position in document_index, token offset in that
  document) of token ``i * seq_length`` of the stream.  Sample i spans rows i..i+1 inclusive of
  the end token, so consecutive samples share their boundary token.
* ``shuffle_index`` (uint32/int64 [N]): a permutation of the samples, from the same generator
  (two ranges, shuffled separately, when the last epoch is separate).

``build_sample_index`` is vectorised numpy (cumulative sums, ceil-divisions, a bincount), a little
faster than Megatron's C++ helper on this machine class and with no compile step.  Documents here
are the sequences of the indexed dataset, as in Megatron-core's GPT dataset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from megatron_lite.data.index_cache import lengths_fingerprint, load_or_build

LAST_EPOCH_THRESHOLD = 0.80  # Megatron: a last epoch below 80% of an epoch is shuffled separately


@dataclass
class GPTDatasetConfig:
    """What determines GPT samples; the training script maps its CLI flags onto these fields."""

    seq_length: int
    """--seq-length: tokens per sample fed to the model (each sample reads seq_length + 1)."""
    seed: int = 1234
    """--seed: seed of the document and sample shuffles."""
    split: str = "969,30,1"
    """--split: train,valid,test weights over the documents of each dataset (normalised)."""
    data_path: list[str] = field(default_factory=list)
    """--data-path: one prefix, or 'w1 prefix1 w2 prefix2 ...' for a weighted blend."""
    per_split_data_paths: list | None = None
    """--train-data-path / --valid-data-path / --test-data-path: each split's own blend, all of its
    documents (a split without one: None); instead of --data-path and --split."""
    data_cache_path: str | None = None
    """--data-cache-path: folder for index caches (default: <data dir>/cache; None+mock: memory)."""
    mmap_bin_files: bool = True
    """--no-mmap-bin-files (False): read the .bin files with file reads instead of memory-mapping them."""
    eod_mask_loss: bool = False
    """--eod-mask-loss: zero the loss where the input token is EOD."""
    reset_position_ids: bool = False
    """--reset-position-ids: restart position ids after every EOD."""
    reset_attention_mask: bool = False
    """--reset-attention-mask: block attention across EOD (adds document_ids to samples)."""
    eod: int | None = None
    """EOD token id (from the tokenizer); needed by the three EOD options above."""
    mock: bool = False
    """--mock-data: synthetic random tokens instead of --data-path."""
    vocab_size: int = 32000
    """Vocabulary size of --mock-data tokens (the tokenizer's vocab_size)."""


# -- index construction (pure functions of numpy arrays) ---------------------------------------------
def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Smallest e with e * tokens_per_epoch >= num_samples * seq_length + 1 (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens")
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


INDEX_BYTES_PER_ENTRY = 14  # per document_index entry while building: int32 id + uint16 length + int64 stream end


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_index_fits(num_documents: int, num_epochs: int, tokens_per_epoch: int, num_samples: int,
                     seq_length: int) -> None:
    """Refuse, before allocating, a document index larger than this machine's memory: a toy split asked for a
    long run's samples (4 tokens for 10^12 was a 977 GiB numpy MemoryError traceback, or the OOM killer)."""
    entries = num_documents * num_epochs
    memory = physical_memory_bytes()
    if memory is not None and entries * INDEX_BYTES_PER_ENTRY > memory:
        raise ValueError(f"{num_samples:,} samples of {seq_length} tokens need {num_epochs:,} epochs of this split's "
                         f"{tokens_per_epoch:,} tokens: a document index of {entries:,} entries "
                         f"(~{entries * INDEX_BYTES_PER_ENTRY / 2**30:,.0f} GiB to build), more than this machine's "
                         f"{memory / 2**30:,.0f} GiB; give more data, or fewer --train-iters / --train-samples")


def separate_last_epoch(tokens_per_epoch: int, num_epochs: int, num_samples: int | None,
                        seq_length: int) -> bool:
    """Megatron's rule: shuffle the last epoch on its own if it supplies < 80% of an epoch's samples."""
    if num_epochs == 1 or num_samples is None:
        return False
    samples_before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_from_last = num_samples - samples_before_last
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return samples_from_last < int(LAST_EPOCH_THRESHOLD * samples_per_epoch)


def build_document_index(document_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_last: bool) -> np.ndarray:
    """document_ids tiled num_epochs times and shuffled (last epoch on its own if separate_last)."""
    if separate_last and num_epochs > 1:
        first = build_document_index(document_ids, num_epochs - 1, rng, False)
        last = build_document_index(document_ids, 1, rng, False)
        return np.concatenate((first, last))
    ids = np.asarray(document_ids)
    # int32 as Megatron (the same cached arrays), int64 when a split has ids past it (over 2^31 sequences)
    dtype = np.int32 if ids.size == 0 or int(ids.max()) < 2**31 else np.int64
    index = np.tile(ids.astype(dtype), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """Rows (position in document_index, offset) of every token ``i * seq_length`` of the stream.

    The stream is the concatenation of ``sizes[document_index]`` tokens; N = (total - 1) //
    seq_length full samples fit (the last one needs its extra label token), giving N + 1 rows.
    Vectorised: with ends[j] the stream position just after document j, the samples starting at
    or after that end are those with i >= c[j] = ceil(ends[j] / s).  So sample i lies in document
    #{j : c[j] <= i}: a bincount of c and a cumulative sum give every sample's document at once,
    and its offset is i * s minus that document's start.  Row 0 is (0, 0) as in Megatron even
    when the first documents are empty (reading skips empty documents anyway).
    """
    sizes = np.asarray(sizes)
    if sizes.size and 0 <= sizes.min() and sizes.max() < 65536:
        sizes = sizes.astype(np.uint16)  # half the bytes: the random gather below is memory-bound
    lengths = np.take(sizes, document_index)
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    if total < 2:
        raise ValueError("a sample needs at least 2 tokens but the split has fewer")
    num_rows = (total - 1) // seq_length + 1
    first_after = ends + (seq_length - 1)
    if seq_length & (seq_length - 1) == 0:
        first_after >>= seq_length.bit_length() - 1  # ceil-divide by a power of two
    else:
        first_after //= seq_length
    document = np.cumsum(np.bincount(first_after, minlength=num_rows + 1)[:num_rows])
    ends -= lengths  # now the start of every document in the stream
    offsets = np.arange(num_rows, dtype=np.int64) * seq_length
    offsets -= ends[document]
    dtype = np.int32 if len(document_index) < 2**31 and total < 2**31 else np.int64
    sample_index = np.empty((num_rows, 2), dtype=dtype)
    sample_index[:, 0] = document
    sample_index[:, 1] = offsets
    sample_index[0] = 0
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, total_size): [0, num_samples) and [num_samples, total_size) shuffled apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, document_ids: np.ndarray, num_samples: int | None,
                      seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """The three index arrays of one split, exactly as Megatron's GPTDataset computes them."""
    document_ids = np.asarray(document_ids)
    tokens_per_epoch = int(np.asarray(sizes)[document_ids].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    if num_samples is not None:
        check_index_fits(len(document_ids), num_epochs, tokens_per_epoch, num_samples, seq_length)
    separate = separate_last_epoch(tokens_per_epoch, num_epochs, num_samples, seq_length)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(document_ids, num_epochs, rng, separate)
    sample_index = build_sample_index(sizes, document_index, seq_length)
    total = sample_index.shape[0] - 1
    if separate:
        before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        shuffle_index = build_shuffle_index(before_last, total, rng)
    else:
        shuffle_index = build_shuffle_index(total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


# -- sample fields --------------------------------------------------------------------------------------
def ltor_fields(tokens: np.ndarray, eod: int | None, eod_mask_loss: bool, reset_position_ids: bool,
                reset_attention_mask: bool) -> dict[str, np.ndarray]:
    """loss_mask, position_ids and (only with reset_attention_mask) document_ids for one sample.

    document_ids (int64 [s]) number the documents of the sample: a new one starts after each EOD (the
    EOD belongs to the document it ends). The model attends causally within a document only - the
    mask Megatron builds densely as bool [1, s, s], here O(s) and split like the tokens under
    context parallelism (megatron_lite.parallel.document_mask).
    """
    s = len(tokens)
    if (eod_mask_loss or reset_position_ids or reset_attention_mask) and eod is None:
        raise ValueError("--eod-mask-loss/--reset-position-ids/--reset-attention-mask need the EOD token id")
    is_eod = tokens == eod if eod is not None else np.zeros(s, dtype=bool)
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = np.arange(s, dtype=np.int64)
    out = {"loss_mask": loss_mask}
    if reset_position_ids:
        restart = np.zeros(s, dtype=np.int64)
        after_eod = np.flatnonzero(is_eod[:-1]) + 1  # a new document starts after each EOD
        restart[after_eod] = after_eod
        position_ids -= np.maximum.accumulate(restart)
    out["position_ids"] = position_ids
    if reset_attention_mask:
        out["document_ids"] = np.concatenate(([0], np.cumsum(is_eod[:-1]))).astype(np.int64)
    return out


class GPTDataset:
    """Samples of one split of one indexed dataset; ``ds[i]`` is a dict of numpy arrays.

    ``document_ids`` are the split's sequence ids (see ``builder.split_ranges``); ``num_samples``
    None means one epoch.  The index arrays come from ``data_cache_path`` when cached there.
    """

    def __init__(self, indexed_dataset, document_ids, num_samples: int | None, config: GPTDatasetConfig,
                 split_name: str = "train", cache_dir: str | None = None):
        self.dataset = indexed_dataset
        self.config = config
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        if self.document_ids.size == 0:
            raise ValueError(f"{split_name} split of {getattr(indexed_dataset, 'path_prefix', '?')} has no "
                             f"documents (--split {config.split!r})")
        self.num_samples = num_samples
        sizes = indexed_dataset.sequence_lengths
        prefix = getattr(indexed_dataset, "path_prefix", None)
        description = {
            "class": type(self).__name__,
            "path_prefix": os.path.abspath(prefix) if prefix else None,
            "num_sequences": int(len(sizes)),
            "sequence_lengths_sha1": lengths_fingerprint(sizes),
            "split": split_name,
            "document_range": [int(self.document_ids[0]), int(self.document_ids[-1]) + 1,
                               int(self.document_ids.size)],
            "num_samples": num_samples,
            "seq_length": config.seq_length,
            "seed": config.seed,
        }
        self.description = description
        if cache_dir is None:
            cache_dir = config.data_cache_path
        arrays, self.index_source = load_or_build(
            cache_dir, description, ["document_index", "sample_index", "shuffle_index"],
            lambda: build_gpt_indices(sizes, self.document_ids, num_samples, config.seq_length, config.seed))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def get_text(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample ``idx`` (after the sample shuffle)."""
        i = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(v) for v in self.sample_index[i])
        doc_end, off_end = (int(v) for v in self.sample_index[i + 1])
        if doc_beg == doc_end:
            return np.asarray(self.dataset.get(int(self.document_index[doc_beg]), off_beg,
                                               off_end - off_beg + 1), dtype=np.int64)
        parts = [self.dataset.get(int(self.document_index[doc_beg]), off_beg)]
        parts += [self.dataset.get(int(self.document_index[j])) for j in range(doc_beg + 1, doc_end)]
        parts.append(self.dataset.get(int(self.document_index[doc_end]), 0, off_end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        text = self.get_text(idx)
        return make_sample(text, self.config)


def make_sample(text: np.ndarray, config: GPTDatasetConfig) -> dict[str, np.ndarray]:
    """The sample dict from seq_length + 1 tokens: tokens, labels, loss_mask, position_ids[, document_ids]."""
    tokens, labels = text[:-1], text[1:]
    fields = ltor_fields(tokens, config.eod, config.eod_mask_loss, config.reset_position_ids,
                         config.reset_attention_mask)
    return {"tokens": tokens, "labels": labels, **fields}


class MockGPTDataset:
    """--mock-data: ``num_samples`` samples of random tokens, a deterministic function of (seed, idx).

    Tokens are drawn from [0, vocab_size); each sample also ends a pseudo-document with the EOD
    token at a random position (when config.eod is set) so the EOD options are exercised.
    """

    def __init__(self, num_samples: int, config: GPTDatasetConfig, split_name: str = "train"):
        self.num_samples = int(num_samples)
        self.config = config
        self.split_offset = {"train": 0, "valid": 1, "test": 2}.get(split_name, 3)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"mock sample {idx} out of range [0, {self.num_samples})")
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, self.split_offset, int(idx)])
        text = rng.integers(0, cfg.vocab_size, cfg.seq_length + 1, dtype=np.int64)
        if cfg.eod is not None:
            text[text == cfg.eod] = (cfg.eod + 1) % cfg.vocab_size
            text[rng.integers(0, cfg.seq_length + 1)] = cfg.eod
        return make_sample(text, cfg)
