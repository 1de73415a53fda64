"""Split ranges, --data-path parsing and build_train_valid_test_datasets on real .bin/.idx files."""

import numpy as np
import pytest

from megatron_lite.data import gpt_dataset
from megatron_lite.data.blended import BlendedDataset
from megatron_lite.data.builder import (
    DataConfigError,
    build_train_valid_test_datasets,
    dataset_config_from_args,
    parse_data_path,
    parse_split,
    split_ranges,
    train_valid_test_num_samples,
)
from megatron_lite.data.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDatasetBuilder


def test_split_ranges_follow_megatron_rounding():
    w = parse_split("949,50,1")
    assert np.allclose(w, [0.949, 0.05, 0.001])
    assert split_ranges(1000, w) == [(0, 949), (949, 999), (999, 1000)]
    # 10 docs: round(9.49)=9, round(0.5)=0, round(0.01)=0 -> bounds 0,9,9,9, shifted by +1 to end at 10
    assert split_ranges(10, w) == [(0, 10), (10, 10), (10, 10)]
    # 7 docs in thirds: round(2.33)=2 each -> 0,2,4,6, every bound after 0 shifted by +1
    assert split_ranges(7, parse_split("1,1,1")) == [(0, 3), (3, 5), (5, 7)]
    assert parse_split("98/2") == [0.98, 0.02, 0.0]
    for n in range(1, 200, 7):  # contiguous, ordered, covering [0, n)
        r = split_ranges(n, parse_split("90,7,3"))
        assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
    assert parse_split(" 98, 2 ") == parse_split("98,2,0") and parse_split("1e2/0") == parse_split("5") == [1.0, 0, 0]
    # a field that is not a number is refused, not skipped ("1,,2" was read as 1,2,0: a valid split instead of a test one)
    for bad in ("", "0,0,0", "1,2,3,4", "-1,2", "98,2,x", "1,,2", "98:2:0", "nan,1", "inf,1", "98,2,"):
        with pytest.raises(DataConfigError, match="--split"):
            parse_split(bad)


def test_data_path_parsing():
    assert parse_data_path(["data/a"]) == (["data/a"], None)
    assert parse_data_path(["3", "a", "1", "b"]) == (["a", "b"], [0.75, 0.25])
    assert parse_data_path("0.5 a 0.5 b") == (["a", "b"], [0.5, 0.5])
    assert parse_data_path(["a", "b", "c"]) == (["a", "b", "c"], None)
    for bad in (["1", "a", "b"], ["1", "a", "x", "b"], ["-1", "a", "2", "b"], ["0", "a", "0", "b"], []):
        with pytest.raises(DataConfigError, match="--data-path"):
            parse_data_path(bad)


def test_data_path_with_a_space_in_it(tmp_path):
    """A prefix (or SFT file) whose path holds a space, as Megatron takes it; it was split into words
    ('d/my.idx: file not found'). An entry that names no dataset is still split ('0.3 a 0.7 b')."""
    (tmp_path / "my data").mkdir()
    spaced, other = write(tmp_path / "my data" / "a b", 10), write(tmp_path / "c", 10, seed=1)
    assert parse_data_path([spaced]) == ([spaced], None)
    assert parse_data_path(["1", spaced, "3", other]) == ([spaced, other], [0.25, 0.75])
    assert parse_data_path([f"1 {other} 1 {other}"]) == ([other, other], [0.5, 0.5])
    jsonl = tmp_path / "my data" / "chats x.jsonl"
    jsonl.write_text("{}\n")
    assert parse_data_path(str(jsonl)) == ([str(jsonl)], None)
    cfg = GPTDatasetConfig(seq_length=16, split="100,0,0", data_path=["2", spaced, "1", other])
    train = build_train_valid_test_datasets(cfg, [20, 0, 0])[0]
    assert isinstance(train, BlendedDataset) and len(train) == 20


def write(prefix, n_docs, seed=0, eod=0):
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(str(prefix), dtype=np.uint16)
    for _ in range(n_docs):
        doc = rng.integers(1, 500, int(rng.integers(5, 60))).astype(np.uint16)
        doc[-1] = eod
        b.add_item(doc)
        b.end_document()
    b.finalize()
    return str(prefix)


def test_single_prefix_splits_and_default_cache(tmp_path):
    p = write(tmp_path / "a", 100)
    cfg = GPTDatasetConfig(seq_length=16, split="80,10,10", data_path=[p])
    train, valid, test = build_train_valid_test_datasets(cfg, [50, 10, 0])
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset) and test is None
    assert train.document_ids.tolist() == list(range(80)) and valid.document_ids.tolist() == list(range(80, 90))
    assert len(train) >= 50 and train.index_source == "built"
    assert (tmp_path / "cache").is_dir()  # default: <data dir>/cache
    train[len(train) - 1]
    again = build_train_valid_test_datasets(cfg, [50, 10, 0])[0]
    assert again.index_source == "loaded"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_float_dataset_is_refused_naming_it(tmp_path, dtype):
    """The .idx format has float dtype codes (for other data than tokens): read as tokens, 1.5 trained as
    1 and 2.7 as 2, silently."""
    prefix = str(tmp_path / "f")
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for _ in range(20):
            b.add_document([1.5, 2.7, 3.2, 4.9], [4])
    cfg = GPTDatasetConfig(seq_length=4, split="100,0,0", data_path=[prefix])
    with pytest.raises(DataFileError, match=f"{prefix}.idx: its dtype is {np.dtype(dtype).name}"):
        build_train_valid_test_datasets(cfg, [4, 0, 0])


def test_blend_through_builder(tmp_path):
    a, b = write(tmp_path / "a", 300, seed=1), write(tmp_path / "b", 300, seed=2)
    cfg = GPTDatasetConfig(seq_length=8, data_path=["0.25", a, "0.75", b], split="98,2,0",
                           data_cache_path=str(tmp_path / "c"))
    train, valid, test = build_train_valid_test_datasets(cfg, [1000, 20, 5])
    assert isinstance(train, BlendedDataset) and len(train) == 1000 and test is None
    assert [len(d) >= n for d, n in zip(train.datasets, (252, 754))] == [True, True]
    share = np.bincount(np.asarray(train.dataset_index), minlength=2) / 1000
    assert abs(share[0] - 0.25) < 0.01
    item = train[999]
    assert item["tokens"].shape == (8,) and int(item["dataset_id"]) in (0, 1)


def _tokens(ds) -> list:
    return [(int(ds[i]["dataset_id"]), ds[i]["tokens"].tolist()) for i in range(len(ds))]


def test_a_weight_0_member_is_not_checked_or_built_and_changes_no_sample(tmp_path):
    """--data-path 0 tiny 1 b 3 c: tiny's valid split gets none of its 2 documents (a refusal if it were
    used) and it holds floats (refused if used); it contributes nothing, so the run builds and every
    sample is --data-path 1 b 3 c's (dataset ids one up). Megatron's order would read tiny at sample 4."""
    b, c, tiny = write(tmp_path / "b", 100, seed=2), write(tmp_path / "c", 100, seed=3), str(tmp_path / "tiny")
    with IndexedDatasetBuilder(tiny, np.float32) as builder:
        for _ in range(2):
            builder.add_document([1.5, 2.5, 3.5], [3])

    def build(data_path):
        cfg = GPTDatasetConfig(seq_length=8, data_path=data_path, split="90,8,2", data_cache_path=str(tmp_path / "cache"))
        return build_train_valid_test_datasets(cfg, [200, 20, 4])

    for zero in (["0", tiny, "1", b, "3", c], ["1", b, "0", tiny, "3", c]):
        pos = zero.index(tiny) // 2
        for got, want in zip(build(zero), build(["1", b, "3", c])):
            assert len(got.datasets[pos]) == 0 and len(got) == len(want)
            assert _tokens(got) == [(d + (d >= pos), t) for d, t in _tokens(want)]
    with pytest.raises(DataFileError, match="^--data-path: .*missing.idx"):  # a missing file is still named
        build(["1", b, "0", str(tmp_path / "missing")])


def test_a_weight_0_member_of_a_per_split_path_is_not_checked(tmp_path):
    a, empty = write(tmp_path / "a", 50, seed=1), str(tmp_path / "empty")
    IndexedDatasetBuilder(empty, dtype=np.uint16).finalize()
    cfg = GPTDatasetConfig(seq_length=8, data_cache_path=str(tmp_path / "cache"),
                           per_split_data_paths=[["1", a, "0", empty], ["0", empty, "2", a], None])
    train, valid, _ = build_train_valid_test_datasets(cfg, [40, 8, 0])
    alone = GPTDatasetConfig(seq_length=8, data_cache_path=str(tmp_path / "c"), per_split_data_paths=[[a], [a], None])
    train_a, valid_a, _ = build_train_valid_test_datasets(alone, [40, 8, 0])
    assert [t for _, t in _tokens(train)] == [train_a[i]["tokens"].tolist() for i in range(40)]
    assert {d for d, _ in _tokens(valid)} == {1} and len(valid) == 8


def test_prefixes_without_weights_are_weighted_by_their_token_counts(tmp_path):
    """docs/data-and-tokenizers.md: several prefixes without weights are weighted by their token counts."""
    from megatron_lite.data.indexed_dataset import IndexedDataset

    a, b = write(tmp_path / "a", 100, seed=1), write(tmp_path / "b", 300, seed=2)
    tokens = [int(IndexedDataset(p).sequence_lengths.sum()) for p in (a, b)]
    cfg = GPTDatasetConfig(seq_length=8, data_path=[a, b], split="100,0,0", data_cache_path=str(tmp_path / "c"))
    train = build_train_valid_test_datasets(cfg, [1000, 0, 0])[0]
    share = np.bincount(np.asarray(train.dataset_index), minlength=2) / 1000
    assert abs(share[0] - tokens[0] / sum(tokens)) < 0.01 and abs(share[0] - 0.5) > 0.2, (share, tokens)


def test_mock_and_errors(tmp_path):
    cfg = GPTDatasetConfig(seq_length=8, mock=True)
    train, valid, test = build_train_valid_test_datasets(cfg, [10, 4, 0])
    assert isinstance(train, MockGPTDataset) and len(valid) == 4 and test is None
    with pytest.raises(DataFileError, match="--data-path.*missing.idx"):
        build_train_valid_test_datasets(GPTDatasetConfig(seq_length=8, data_path=[str(tmp_path / "missing")]),
                                        [10, 0, 0])
    p = write(tmp_path / "small", 10)
    with pytest.raises(DataConfigError, match="--split 949,50,1: the valid split"):
        build_train_valid_test_datasets(GPTDatasetConfig(seq_length=8, split="949,50,1", data_path=[p]),
                                        [10, 2, 0])
    # the same tiny data is fine when no validation samples are requested
    assert build_train_valid_test_datasets(GPTDatasetConfig(seq_length=8, split="949,50,1", data_path=[p]),
                                           [10, 0, 0])[1] is None


@pytest.mark.parametrize("split", ["0,0,100", "0,1,0", "0, 3, 1"])
def test_train_split_of_weight_0_is_refused_when_training(tmp_path, split):
    """--split 0,0,100 with training steps: one DataConfigError naming --split (the train dataset was
    None, and the first training step failed with "'NoneType' object is not an iterator")."""
    p = write(tmp_path / "a", 50)
    cfg = GPTDatasetConfig(seq_length=8, split=split, data_path=[p], data_cache_path=str(tmp_path / "c"))
    with pytest.raises(DataConfigError, match=f"--split {split} gives the train split weight 0.*10 train samples"):
        build_train_valid_test_datasets(cfg, [10, 4, 4])
    # evaluation-only use (no train samples asked for) still builds the other splits
    train, valid, test = build_train_valid_test_datasets(cfg, [0, 4, 4])
    assert train is None and (valid is not None or test is not None)


def test_config_from_args_and_sample_counts(tmp_path):
    import argparse

    from megatron_lite.data.samplers import build_data_iterators
    from megatron_lite.data.tokenizers import NullTokenizer

    p = write(tmp_path / "a", 200, eod=500)
    args = argparse.Namespace(seq_length=16, seed=9, split="90,5,5", data_path=[p], data_cache_path=None,
                              mock_data=False, eod_mask_loss=True, reset_position_ids=False,
                              reset_attention_mask=False)
    tok = NullTokenizer(500)
    cfg = dataset_config_from_args(args, tok)
    assert cfg.eod == 500 and cfg.eod_mask_loss and cfg.seed == 9 and cfg.vocab_size == 501
    # Megatron: valid = (train_iters // eval_interval + 1) * eval_iters * global batch
    assert train_valid_test_num_samples(100, 8, 50, 2) == [800, 48, 16]
    train, valid, test = build_train_valid_test_datasets(cfg, train_valid_test_num_samples(20, 4, 10, 2), tok)
    it_train, it_valid, it_test = build_data_iterators(train, valid, test, 0, 0, micro_batch_size=2,
                                                       data_parallel_rank=0, data_parallel_size=2)
    batch = next(it_train)
    assert batch["tokens"].shape == (2, 16) and batch["labels"].shape == (2, 16)
    assert (batch["loss_mask"] == (batch["tokens"] != 500).float()).all()
    assert next(it_valid)["tokens"].shape == (2, 16) and next(it_test)["tokens"].shape == (2, 16)


def test_a_toy_split_asked_for_a_long_runs_samples_is_refused_before_allocating(tmp_path, monkeypatch):
    """4 tokens asked for 10^9 samples of 2048 tokens need 5 * 10^11 epochs: building that document index was a
    numpy MemoryError traceback (977 GiB) or, where memory is overcommitted, the OOM killer. Now one line naming
    the data, the split and what to change, before anything is allocated."""
    prefix = str(tmp_path / "toy")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_document([1, 2, 3, 0], [4])
    cfg = GPTDatasetConfig(seq_length=2048, split="100,0,0", data_path=[prefix], data_cache_path=str(tmp_path / "c"))
    with pytest.raises(DataConfigError, match=r"toy, train split .*need 512,000,000,001 epochs of this split's 4 tokens"
                                              r".*fewer --train-iters"):
        build_train_valid_test_datasets(cfg, [10**9, 0, 0])
    # the bound is this machine's memory: where it does not hold even a small index, that is refused too
    monkeypatch.setattr(gpt_dataset, "physical_memory_bytes", lambda: 1000)
    with pytest.raises(DataConfigError, match="more than this machine's"):
        build_train_valid_test_datasets(cfg, [100, 0, 0])


def test_a_dataset_of_only_empty_documents_says_so(tmp_path):
    """A corpus whose texts are all empty (or a wrong --json-keys picking an empty field) preprocesses to
    documents with no sequences. Training on it said 'the train split gets none of its 0 documents; use
    more data or change --split' (and '--valid-data-path X has no documents'), counting sequences as
    documents and advising a --split that cannot help; now one line says its documents are empty."""
    empty, good = str(tmp_path / "empty"), write(tmp_path / "good", 40)
    with IndexedDatasetBuilder(empty, np.uint16) as builder:
        builder.end_document()
        builder.end_document()
    nothing = str(tmp_path / "nothing")
    IndexedDatasetBuilder(nothing, np.uint16).finalize()
    cases = [(GPTDatasetConfig(seq_length=8, data_path=[empty], split="90,8,2"), f"^--data-path {empty} "),
             (GPTDatasetConfig(seq_length=8, data_path=["1", good, "1", empty], split="90,8,2"), f"^--data-path {empty} "),
             (GPTDatasetConfig(seq_length=8, per_split_data_paths=[[good], [empty], None]), f"^--valid-data-path {empty} ")]
    for cfg, where in cases:
        with pytest.raises(DataConfigError, match=where + "holds no tokens: its 2 documents are all empty") as err:
            build_train_valid_test_datasets(cfg, [4, 4, 0])
        assert "--split" not in str(err.value) and "--json-keys" in str(err.value)
    with pytest.raises(DataConfigError, match=f"^--data-path {nothing} has no documents") as err:
        build_train_valid_test_datasets(GPTDatasetConfig(seq_length=8, data_path=[nothing], split="90,8,2"), [4, 4, 0])
    assert "--split" not in str(err.value)
