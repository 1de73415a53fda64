"""BERT samples: structure, segment order, masking proportions and whole words, mapping, caching."""

import numpy as np
import pytest

from megatron_lite.data.bert_dataset import BertDataset, BertDatasetConfig, build_bert_mapping, num_to_predict
from megatron_lite.data.builder import build_train_valid_test_datasets
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

PAD, CLS, SEP, MASK = 0, 1, 2, 3
FIRST_WORD_ID = 10  # data tokens start here so they never collide with special ids


class Tokenizer:
    """Stand-in WordPiece tokenizer: odd ids >= 11 are "##" continuation pieces."""

    vocab_size = 100_000
    pad, cls, sep, mask = PAD, CLS, SEP, MASK

    def __init__(self, continuations=True):
        self.continuations = continuations

    @property
    def inv_vocab(self):
        if not self.continuations:
            return None
        return _Pieces()


class _Pieces:
    def get(self, i, default=""):
        return f"##p{i}" if i >= 11 and i % 2 == 1 else f"w{i}"


def write_sentences(prefix, n_docs, rng, unique=True):
    """Documents of 1-8 sentences of 3-30 tokens; with unique=True tokens increase through the file."""
    b = IndexedDatasetBuilder(str(prefix), dtype=np.int32)
    next_token = FIRST_WORD_ID
    for _ in range(n_docs):
        for _ in range(int(rng.integers(1, 9))):
            n = int(rng.integers(3, 31))
            if unique:
                sent = np.arange(next_token, next_token + 2 * n, 2, dtype=np.int32)  # even: word starts
                next_token += 2 * n
            else:
                sent = rng.integers(FIRST_WORD_ID, 60, n).astype(np.int32)
            b.add_item(sent)
        b.end_document()
    b.finalize()
    return IndexedDataset(str(prefix))


def reference_mapping_epoch(sizes, doc_idx, doc_ids, targets, min_sent):
    """Per document, close a sample when the target is reached and >= 2 sentences remain, or at the end."""
    rows = []
    for d in doc_ids:
        lo, hi = int(doc_idx[d]), int(doc_idx[d + 1])
        if hi - lo < min_sent or (hi - lo > 1 and any(sizes[s] > 512 for s in range(lo, hi))):
            continue
        start, length, count = lo, 0, 0
        for s in range(lo, hi):
            length, count = length + int(sizes[s]), count + 1
            remaining = hi - s - 1
            if (length >= targets[start] and remaining > 1 and count >= min_sent) or remaining == 0:
                rows.append((start, s + 1, int(targets[start])))
                start, length, count = s + 1, 0, 0
    return sorted(rows)


def test_mapping_matches_reference_one_epoch(tmp_path):
    rng = np.random.default_rng(0)
    ds = write_sentences(tmp_path / "s", 80, rng)
    ids = np.arange(5, 75)
    for binary_head in (True, False):
        mapping = build_bert_mapping(ds.sequence_lengths, ds.document_indices, ids, None, 64, 0.3, 7, binary_head)
        # Recover the per-sentence targets the way build_bert_mapping draws them, then compare.
        r = np.random.RandomState(7)
        starts = ds.document_indices[ids]
        ends = ds.document_indices[ids + 1]
        lo, hi = int(starts.min()), int(ends.max())
        targets = np.full(hi, 61)
        short = r.random_sample(hi - lo) < 0.3
        targets[lo:][short] = r.randint(2, 62, size=int(short.sum()))
        ref = reference_mapping_epoch(ds.sequence_lengths, ds.document_indices, ids, targets, 2 if binary_head else 1)
        assert sorted(map(tuple, mapping.tolist())) == ref
        assert len({t for _, _, t in ref}) > 2  # short targets were drawn


def test_sample_structure_segments_and_padding(tmp_path):
    ds = write_sentences(tmp_path / "s", 60, np.random.default_rng(1))
    cfg = BertDatasetConfig(seq_length=48, seed=3)
    bert = BertDataset(ds, np.arange(60), 400, cfg, Tokenizer())
    assert len(bert) >= 400
    randoms = []
    for i in range(400):
        s = bert[i]
        text, types, labels, pad = s["text"], s["types"], s["labels"], s["padding_mask"]
        n = int(pad.sum())
        assert text.shape == (48,) and np.all(pad[:n] == 1) and np.all(pad[n:] == 0)
        assert np.all(text[n:] == PAD) and np.all(types[n:] == 0)
        original = np.where(labels != -1, labels, text)
        seps = np.flatnonzero(original[:n] == SEP)
        assert original[0] == CLS and len(seps) == 2 and seps[1] == n - 1
        assert np.all(types[:seps[0] + 1] == 0) and np.all(types[seps[0] + 1:n] == 1)
        a, b = original[1:seps[0]], original[seps[0] + 1:n - 1]
        assert len(a) and len(b)
        # tokens increase through the file: A before B unless swapped (is_random)
        randoms.append(int(s["is_random"]))
        assert (a.max() > b.min()) == bool(s["is_random"])
        assert np.all(np.diff(a) > 0) and np.all(np.diff(b) > 0)  # contiguous runs, only trimmed at ends
        assert n <= 48
        np.testing.assert_array_equal(s["loss_mask"], labels != -1)
    assert abs(np.mean(randoms) - 0.5) < 0.1  # 400 draws: std 0.025
    again = bert[17]
    for k, v in bert[17].items():
        np.testing.assert_array_equal(v, again[k])  # deterministic per (seed, index)


def test_masking_proportions_and_whole_words(tmp_path):
    ds = write_sentences(tmp_path / "s", 200, np.random.default_rng(2), unique=False)
    cfg = BertDatasetConfig(seq_length=128, seed=5)
    bert = BertDataset(ds, np.arange(200), 600, cfg, Tokenizer())
    regular = predicted = 0
    kinds = np.zeros(3)  # [MASK], random, unchanged
    multi_word_spans = 0
    for i in range(600):
        s = bert[i]
        n = int(s["padding_mask"].sum())
        labels, text = s["labels"][:n], s["text"][:n]
        original = np.where(labels != -1, labels, text)
        special = (original == CLS) | (original == SEP)
        regular += n  # Megatron counts [CLS]/[SEP] too (never predicted)
        pos = np.flatnonzero(labels != -1)
        predicted += len(pos)
        assert not special[pos].any()
        kinds += [np.sum(text[pos] == MASK), np.sum((text[pos] != MASK) & (text[pos] != labels[pos])),
                  np.sum(text[pos] == labels[pos])]
        # whole words: a "##" piece (odd id) is predicted iff the token before it is
        cont = np.flatnonzero((original % 2 == 1) & ~special)
        cont = cont[cont > 0]
        cont = cont[~special[cont - 1]]
        np.testing.assert_array_equal(labels[cont] != -1, labels[cont - 1] != -1)
        words_masked = np.flatnonzero((labels != -1) & (original % 2 == 0))
        multi_word_spans += int(np.sum(np.diff(words_masked) == 1))
    # 0.15 of all tokens, rounded per sample (and capped by whole-word fits): within 1%
    assert abs(predicted / regular - 0.15) < 0.01
    # of those: 80 / 10 / 10 within 2.5% (about 4 standard deviations for ~9,000 tokens)
    share = kinds / kinds.sum()
    assert np.all(np.abs(share - [0.8, 0.1, 0.1]) < 0.025), share
    assert multi_word_spans > 0  # n-grams of several words occur


def test_no_binary_head_and_builder_cache(tmp_path):
    ds = write_sentences(tmp_path / "s", 40, np.random.default_rng(3))
    cfg = BertDatasetConfig(seq_length=32, binary_head=False, data_path=[str(tmp_path / "s")],
                            split="90,10,0", data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(cfg, [100, 10, 0], Tokenizer(continuations=False))
    assert isinstance(train, BertDataset) and test is None and train.index_source == "built"
    assert train.document_ids.tolist() == list(range(36))
    s = train[0]
    n = int(s["padding_mask"].sum())
    original = np.where(s["labels"] != -1, s["labels"], s["text"])[:n]
    assert original[0] == CLS and original[-1] == SEP and np.sum(original == SEP) == 1
    assert np.all(s["types"] == 0) and int(s["is_random"]) == 0
    again = build_train_valid_test_datasets(cfg, [100, 10, 0], Tokenizer(continuations=False))[0]
    assert again.index_source == "loaded"
    np.testing.assert_array_equal(again.samples_mapping, train.samples_mapping)
    with pytest.raises(ValueError, match="tokenizer"):
        BertDataset(ds, np.arange(40), 10, cfg, None)


def test_cache_of_a_rewritten_dataset_with_other_document_boundaries_is_not_reused(tmp_path):
    """Same path, same sentence lengths, same number of documents, other boundaries (sentences
    regrouped): the cached mapping of the old grouping was loaded, pairing sentences across documents."""
    lengths = [5, 6, 7, 8, 9, 10, 11, 12] * 6

    def write(sentences_per_doc):
        b = IndexedDatasetBuilder(str(tmp_path / "s"), dtype=np.int32)
        ends = set(np.cumsum(sentences_per_doc).tolist())
        for i, n in enumerate(lengths):
            b.add_item(np.arange(FIRST_WORD_ID, FIRST_WORD_ID + n, dtype=np.int32))
            if i + 1 in ends:
                b.end_document()
        b.finalize()

    cfg = BertDatasetConfig(seq_length=64, data_path=[str(tmp_path / "s")], split="1,0,0",
                            data_cache_path=str(tmp_path / "cache"))
    write([4] * 12)
    assert build_train_valid_test_datasets(cfg, [20, 0, 0], Tokenizer())[0].index_source == "built"
    write([2, 6] * 6)  # 12 documents again
    second = build_train_valid_test_datasets(cfg, [20, 0, 0], Tokenizer())[0]
    assert second.index_source == "built"
    doc_idx = np.asarray(IndexedDataset(str(tmp_path / "s")).document_indices)
    for first_sentence, end, _ in second.samples_mapping:  # every sample lies inside one document
        doc = int(np.searchsorted(doc_idx, first_sentence, side="right")) - 1
        assert int(end) <= int(doc_idx[doc + 1])


def test_split_of_single_sentence_documents_is_a_data_config_error(tmp_path):
    """A split whose documents all have one sentence gives no sentence pair: DataConfigError (exit 2
    in pretrain_bert.py) naming --split and the split, not a ValueError traceback."""
    from megatron_lite.data.builder import DataConfigError

    b = IndexedDatasetBuilder(str(tmp_path / "s"), dtype=np.int32)
    for doc in range(10):
        for _ in range(3 if doc < 8 else 1):  # the last two documents (the valid split) have one sentence
            b.add_item(np.arange(FIRST_WORD_ID, FIRST_WORD_ID + 12, 2, dtype=np.int32))
        b.end_document()
    b.finalize()
    cfg = BertDatasetConfig(seq_length=32, data_path=[str(tmp_path / "s")], split="80,20,0",
                            data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(DataConfigError, match=r"valid split \(--split 80,20,0\): none of its 2 documents.*--bert-no-binary-head"):
        build_train_valid_test_datasets(cfg, [10, 4, 0], Tokenizer())
    assert build_train_valid_test_datasets(cfg, [10, 0, 0], Tokenizer())[0] is not None  # no valid samples asked
    cfg.binary_head = False  # one sentence is a sample without the sentence-order head
    assert build_train_valid_test_datasets(cfg, [10, 4, 0], Tokenizer())[1] is not None


def _one_sentence_documents(prefix, lengths):
    b = IndexedDatasetBuilder(str(prefix), dtype=np.int32)
    next_token = FIRST_WORD_ID
    for n in lengths:
        b.add_item(np.arange(next_token, next_token + 2 * n, 2, dtype=np.int32))
        next_token += 2 * n
        b.end_document()
    b.finalize()
    return IndexedDataset(str(prefix))


def test_mask_count_counts_cls_and_sep_like_megatron(tmp_path):
    """Megatron predicts min(int(p * target), max(1, round(p * len(tokens)))) with [CLS]/[SEP] in
    len(tokens); the count used only the non-special tokens (10 tokens gave 1 prediction, not 2)."""
    # (tokens incl. [CLS]/[SEP], target) -> expected, by hand at p = 0.15
    cases = {(10, 61): 2, (24, 61): 4, (5, 61): 1, (42, 61): 6, (64, 61): 9, (12, 5): 0, (12, 7): 1}
    for (tokens, target), expected in cases.items():
        assert num_to_predict(tokens, 0.15, target) == expected, (tokens, target)
    # through the dataset: one-sentence documents without the binary head are [CLS] sentence [SEP]
    lengths = {8: 2, 22: 4, 3: 1, 40: 6, 13: 2}  # sentence length -> predictions (15 tokens: round(2.25))
    ds = _one_sentence_documents(tmp_path / "s", list(lengths))
    cfg = BertDatasetConfig(seq_length=64, seed=9, short_seq_prob=0.0, binary_head=False, max_ngrams=1)
    bert = BertDataset(ds, np.arange(len(lengths)), None, cfg, Tokenizer(continuations=False))
    seen = {}
    for i in range(len(bert)):
        s = bert[i]
        seen[int(s["padding_mask"].sum()) - 2] = int(s["loss_mask"].sum())
    assert seen == lengths


def test_long_one_sentence_document_is_kept_and_truncated_without_binary_head(tmp_path):
    """Megatron checks for sentences over 512 tokens only in documents of >= 2 sentences: a
    one-sentence document of 600 tokens is a (truncated) sample without the binary head; it was skipped."""
    b = IndexedDatasetBuilder(str(tmp_path / "s"), dtype=np.int32)
    for sentences in ([600], [10], [600, 10]):  # the last: 2 sentences, one long -> skipped, as in Megatron
        for n in sentences:
            b.add_item(np.arange(FIRST_WORD_ID, FIRST_WORD_ID + 2 * n, 2, dtype=np.int32))
        b.end_document()
    b.finalize()
    ds = IndexedDataset(str(tmp_path / "s"))
    mapping = build_bert_mapping(ds.sequence_lengths, ds.document_indices, np.arange(3), None, 64, 0.0, 1,
                                 binary_head=False)
    assert sorted(map(tuple, mapping.tolist())) == [(0, 1, 61), (1, 2, 61)]
    cfg = BertDatasetConfig(seq_length=64, seed=9, short_seq_prob=0.0, binary_head=False)
    bert = BertDataset(ds, np.arange(3), None, cfg, Tokenizer(continuations=False))
    long_sample = next(bert[i] for i in range(len(bert)) if int(bert.samples_mapping[i][0]) == 0)
    assert int(long_sample["padding_mask"].sum()) == 61 + 2 and int(long_sample["truncated"]) == 1
    with pytest.raises(ValueError, match="none of its 3 documents"):  # with the head: no pair anywhere
        build_bert_mapping(ds.sequence_lengths, ds.document_indices, np.arange(3), None, 64, 0.0, 1)


def test_sentence_split_data_of_one_sentence_documents_is_not_called_document_level(tmp_path):
    """pretrain_bert.py's check for the binary head: data preprocessed with --split-sentences whose
    documents are each one sentence (or empty) gives no pair either. The line said only 'is
    document-level' and told the user to pass --split-sentences, which they had."""
    import pretrain_bert
    from megatron_lite.data.builder import DataConfigError

    _one_sentence_documents(tmp_path / "one", [5, 7, 3])
    with pytest.raises(DataConfigError) as err:
        pretrain_bert.check_sentence_level([str(tmp_path / "one")])
    for words in ("has no document of two or more sequences", "every document one sentence or empty",
                  "--split-sentences", "--bert-no-binary-head"):
        assert words in str(err.value), err.value
    b = IndexedDatasetBuilder(str(tmp_path / "two"), dtype=np.int32)
    for _ in range(2):
        b.add_item(np.arange(FIRST_WORD_ID, FIRST_WORD_ID + 6, 2, dtype=np.int32))
    b.end_document()
    b.finalize()
    pretrain_bert.check_sentence_level([str(tmp_path / "two")])  # one document of two sentences: pairs exist
