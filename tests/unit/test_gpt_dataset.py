"""GPT dataset indices against a plain-Python reference, sample contents, and the index cache."""

import multiprocessing as mp
import os

import numpy as np
import pytest

from megatron_lite.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    build_document_index,
    build_gpt_indices,
    build_sample_index,
)
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDataset, IndexedDatasetBuilder


# -- independent references (plain loops over Megatron's index definitions) ------------------------
def reference_sample_index(sizes, document_index, seq_length):
    """Walk the shuffled stream sample by sample: each takes seq_length + 1 tokens, sharing the last."""
    total = sum(int(sizes[d]) for d in document_index)
    rows = [(0, 0)]
    pos, off = 0, 0
    for _ in range((total - 1) // seq_length):
        remaining = seq_length + 1  # tokens to consume, counting the current start token
        while True:
            available = int(sizes[document_index[pos]]) - off
            if remaining <= available:
                off += remaining - 1  # the last consumed token starts the next sample
                break
            remaining -= available
            pos, off = pos + 1, 0
        rows.append((pos, off))
    return np.array(rows, dtype=np.int64)


def reference_indices(sizes, document_ids, num_samples, seq_length, seed):
    tokens_per_epoch = sum(int(sizes[d]) for d in document_ids)
    epochs = 1
    while num_samples is not None and epochs * tokens_per_epoch < num_samples * seq_length + 1:
        epochs += 1
    separate = False
    if epochs > 1:
        from_last = num_samples - ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = from_last < int(0.8 * per_epoch)
    rng = np.random.RandomState(seed)
    if separate:
        first = np.array(list(document_ids) * (epochs - 1), dtype=np.int32)
        rng.shuffle(first)
        last = np.array(list(document_ids), dtype=np.int32)
        rng.shuffle(last)
        doc_index = np.concatenate([first, last])
    else:
        doc_index = np.array(list(document_ids) * epochs, dtype=np.int32)
        rng.shuffle(doc_index)
    sample_index = reference_sample_index(sizes, doc_index, seq_length)
    n = len(sample_index) - 1
    cut = ((epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else n
    a = np.arange(cut)
    rng.shuffle(a)
    b = np.arange(cut, n)
    if cut < n:
        rng.shuffle(b)
    return doc_index, sample_index, np.concatenate([a, b]), separate


def test_vectorised_sample_index_equals_loop_on_random_sizes():
    rng = np.random.default_rng(0)
    for _ in range(30):
        sizes = rng.integers(0, 40, size=int(rng.integers(1, 60)))  # includes empty documents
        sizes[rng.integers(len(sizes))] = max(2, sizes.max())  # at least 2 tokens overall
        doc_index = rng.permutation(np.repeat(np.arange(len(sizes)), rng.integers(1, 4)))
        seq = int(rng.integers(1, 50))
        np.testing.assert_array_equal(build_sample_index(sizes, doc_index, seq),
                                      reference_sample_index(sizes, doc_index, seq))


def test_document_ids_past_int32_keep_their_value():
    """A split of more than 2^31 sequences (a --split-sentences corpus of billions of sentences: the .idx
    holds them, its counts and pointers are 64-bit) had its document ids cast to int32 in document_index:
    ids from 2^31 on wrapped to negative numbers, which numpy's take then read from the end of the sizes
    array, so samples came silently from the wrong sentences. Small ids keep Megatron's int32 (same cache)."""
    big = np.array([2**31 + 7, 3, 2**32 + 1], dtype=np.int64)
    index = build_document_index(big, 2, np.random.RandomState(0), separate_last=True)
    assert sorted(index.tolist()) == sorted(big.tolist() * 2)
    small = build_document_index(np.arange(5), 2, np.random.RandomState(0), separate_last=False)
    assert small.dtype == np.int32 and sorted(small.tolist()) == sorted(list(range(5)) * 2)


def test_all_indices_equal_reference_including_last_epoch_rule():
    rng = np.random.default_rng(1)
    seen_separate = set()
    for trial in range(40):
        sizes = rng.integers(1, 30, size=int(rng.integers(5, 40)))
        lo = int(rng.integers(0, 3))
        doc_ids = np.arange(lo, len(sizes))
        seq = int(rng.integers(2, 20))
        tokens = int(sizes[doc_ids].sum())
        num_samples = int(rng.integers(1, 4 * tokens // seq + 2))
        got = build_gpt_indices(sizes, doc_ids, num_samples, seq, seed=trial)
        ref_doc, ref_sample, ref_shuffle, separate = reference_indices(sizes, doc_ids, num_samples, seq, trial)
        seen_separate.add(separate)
        np.testing.assert_array_equal(got["document_index"], ref_doc)
        np.testing.assert_array_equal(got["sample_index"], ref_sample)
        np.testing.assert_array_equal(got["shuffle_index"], ref_shuffle)
        assert len(got["sample_index"]) - 1 >= num_samples
    assert seen_separate == {True, False}  # both branches of the last-epoch rule were exercised


# -- fixtures on real .bin/.idx files ---------------------------------------------------------------
def write_dataset(prefix, sizes, eod=None):
    """Documents of the given sizes whose tokens are their global positions (unique), EOD-terminated."""
    builder = IndexedDatasetBuilder(str(prefix), dtype=np.int32)
    start = 0
    for size in sizes:
        tokens = np.arange(start, start + size, dtype=np.int32) + 10
        if eod is not None:
            tokens[-1] = eod
        builder.add_item(tokens)
        builder.end_document()
        start += size
    builder.finalize()
    return IndexedDataset(str(prefix))


def test_samples_overlap_by_one_token_and_cover_an_epoch(tmp_path):
    sizes = [7, 3, 12, 5, 9, 1, 4, 8]
    seq = 4
    ds_file = write_dataset(tmp_path / "d", sizes)
    ids = np.arange(1, 7)  # a split of documents 1..6
    cfg = GPTDatasetConfig(seq_length=seq, seed=5)
    ds = GPTDataset(ds_file, ids, None, cfg)
    texts = [ds.get_text(i) for i in range(len(ds))]
    for t in texts:
        assert len(t) == seq + 1
    sample = ds[0]
    np.testing.assert_array_equal(sample["tokens"], texts[0][:-1])
    np.testing.assert_array_equal(sample["labels"], texts[0][1:])
    # In stream order (undo the sample shuffle), sample i's last token is sample i+1's first.
    order = np.argsort(ds.shuffle_index)
    stream = [texts[j] for j in order]
    for a, b in zip(stream, stream[1:]):
        assert a[-1] == b[0]
    # One epoch: every token of the split appears exactly once, except a tail shorter than seq.
    used = np.concatenate([s[:-1] for s in stream] + [stream[-1][-1:]])
    split_tokens = np.concatenate([ds_file[int(d)] for d in ids])
    assert len(np.unique(used)) == len(used)
    assert set(used) <= set(split_tokens)
    assert len(split_tokens) - len(used) < seq


def test_sample_text_is_a_window_of_the_shuffled_stream_over_epochs(tmp_path):
    sizes = [5, 0, 9, 2, 14, 1, 7]  # includes an empty document
    ds_file = write_dataset(tmp_path / "d", sizes)
    seq = 6
    ds = GPTDataset(ds_file, np.arange(7), 25, GPTDatasetConfig(seq_length=seq, seed=11))  # several epochs
    stream = np.concatenate([ds_file[int(d)] for d in ds.document_index])
    assert len(ds) >= 25 and len(ds.document_index) > 7
    for j in range(len(ds)):
        i = int(ds.shuffle_index[j])
        np.testing.assert_array_equal(ds.get_text(j), stream[i * seq:(i + 1) * seq + 1])
    assert sorted(np.asarray(ds.shuffle_index).tolist()) == list(range(len(ds)))


def test_eod_options_mask_loss_reset_positions_and_attention(tmp_path):
    eod = 1
    ds_file = write_dataset(tmp_path / "d", [3, 4, 6, 5], eod=eod)
    cfg = GPTDatasetConfig(seq_length=8, seed=0, eod=eod, eod_mask_loss=True, reset_position_ids=True,
                           reset_attention_mask=True)
    ds = GPTDataset(ds_file, np.arange(4), None, cfg)
    for i in range(len(ds)):
        s = ds[i]
        tokens = s["tokens"]
        np.testing.assert_array_equal(s["loss_mask"], (tokens != eod).astype(np.float32))
        # Reference: position restarts at 0 after each EOD; attention stays inside a document.
        pos, expect_pos = 0, []
        doc, docs = 0, []
        for t in tokens:
            expect_pos.append(pos)
            docs.append(doc)
            pos, doc = (0, doc + 1) if t == eod else (pos + 1, doc)
        np.testing.assert_array_equal(s["position_ids"], expect_pos)
        np.testing.assert_array_equal(s["document_ids"], docs)  # the model attends within one id
    plain = GPTDataset(ds_file, np.arange(4), None, GPTDatasetConfig(seq_length=8, seed=0))[0]
    assert "document_ids" not in plain
    np.testing.assert_array_equal(plain["position_ids"], np.arange(8))
    assert plain["loss_mask"].dtype == np.float32 and plain["loss_mask"].min() == 1.0


def test_cache_is_written_reloaded_and_rebuilt_identically(tmp_path):
    ds_file = write_dataset(tmp_path / "d", list(range(1, 40)))
    cfg = GPTDatasetConfig(seq_length=16, seed=3, data_cache_path=str(tmp_path / "cache"))
    first = GPTDataset(ds_file, np.arange(30), 200, cfg)
    assert first.index_source == "built"
    second = GPTDataset(ds_file, np.arange(30), 200, cfg)
    assert second.index_source == "loaded"
    folders = [f for f in os.listdir(tmp_path / "cache") if not f.endswith(".lock")]
    assert len(folders) == 1
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    rebuilt = GPTDataset(ds_file, np.arange(30), 200, GPTDatasetConfig(seq_length=16, seed=3))  # memory
    assert rebuilt.index_source == "memory"
    np.testing.assert_array_equal(rebuilt.sample_index, first.sample_index)
    np.testing.assert_array_equal(rebuilt.shuffle_index, first.shuffle_index)
    other_seed = GPTDataset(ds_file, np.arange(30), 200, GPTDatasetConfig(seq_length=16, seed=4,
                                                                          data_cache_path=str(tmp_path / "cache")))
    assert other_seed.index_source == "built"  # a different key, a different folder
    assert not np.array_equal(other_seed.shuffle_index, first.shuffle_index)



def test_cache_folder_is_as_readable_as_any_new_folder(tmp_path):
    """The cache folder was created private (0700, mkdtemp's mode), so another user or job sharing the
    data folder could not read the cache that sits in <data dir>/cache; now it has the umask's mode."""
    ds_file = write_dataset(tmp_path / "d", list(range(1, 40)))
    GPTDataset(ds_file, np.arange(30), 20, GPTDatasetConfig(seq_length=16, data_cache_path=str(tmp_path / "cache")))
    (tmp_path / "plain").mkdir()
    folder = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    assert folder.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
    assert all(f.stat().st_mode & 0o044 == (tmp_path / "plain").stat().st_mode & 0o044 for f in folder.iterdir())


def test_rewritten_dataset_gets_a_new_cache(tmp_path):
    cfg = GPTDatasetConfig(seq_length=8, seed=3, data_cache_path=str(tmp_path / "cache"))
    first = GPTDataset(write_dataset(tmp_path / "d", [40] * 30), np.arange(30), 50, cfg)
    # the same prefix re-preprocessed with shorter documents: the old indices would run off their ends
    second = GPTDataset(write_dataset(tmp_path / "d", [9] * 30), np.arange(30), 50, cfg)
    assert (first.index_source, second.index_source) == ("built", "built")
    assert all(len(second[i]["tokens"]) == 8 for i in range(len(second)))


@pytest.mark.parametrize("size", [0, 100, -8])
def test_a_damaged_cache_file_is_one_error_naming_it(tmp_path, size):
    """A cached .npy cut short (empty, inside its header, or missing its last bytes) is a DataFileError
    naming the file and the folder to delete, not a numpy EOFError / ValueError about the --data-path."""
    ds_file = write_dataset(tmp_path / "d", list(range(1, 40)))
    cfg = GPTDatasetConfig(seq_length=16, seed=3, data_cache_path=str(tmp_path / "cache"))
    assert GPTDataset(ds_file, np.arange(30), 200, cfg).index_source == "built"
    (folder,) = [f for f in (tmp_path / "cache").iterdir() if f.is_dir()]
    damaged = folder / "sample_index.npy"
    os.truncate(damaged, size if size >= 0 else damaged.stat().st_size + size)
    with pytest.raises(DataFileError, match="sample_index.npy: damaged index cache") as err:
        GPTDataset(ds_file, np.arange(30), 200, cfg)
    assert f"delete {folder}" in str(err.value)


def test_a_cache_that_cannot_be_written_is_one_error_naming_the_flag(tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", disk_full)
    ds_file = write_dataset(tmp_path / "d", list(range(1, 40)))
    cfg = GPTDatasetConfig(seq_length=16, seed=3, data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(DataFileError, match="--data-cache-path .*No space left on device"):
        GPTDataset(ds_file, np.arange(30), 200, cfg)
    assert [f.name for f in (tmp_path / "cache").iterdir() if not f.name.endswith(".lock")] == []


def _build_in_process(prefix, cache, barrier, results):
    barrier.wait()  # all three reach the cache check at the same moment
    ds = GPTDataset(IndexedDataset(prefix), np.arange(200), 3000,
                    GPTDatasetConfig(seq_length=32, seed=7, data_cache_path=cache))
    results.put((ds.index_source, [np.asarray(getattr(ds, n)).tobytes() for n in
                                   ("document_index", "sample_index", "shuffle_index")]))


def test_concurrent_builders_make_one_cache(tmp_path, monkeypatch):
    """Three processes miss the cache at once; the first to take the lock builds, and it does not
    finish until the other two have reached the lock too (all three have seen no cache, so each
    would build without the lock: that is the race). They then wait on the lock and load."""
    import fcntl
    import time
    from types import SimpleNamespace

    import megatron_lite.data.gpt_dataset as gpt_module
    import megatron_lite.data.index_cache as cache_module

    ctx = mp.get_context("fork")
    at_lock = ctx.Value("i", 0)  # processes that reached the lock (passed the first cache check)

    def counting_flock(f, op):
        if op == fcntl.LOCK_EX:
            with at_lock.get_lock():
                at_lock.value += 1
        return fcntl.flock(f, op)

    real_build = gpt_module.build_gpt_indices

    def build_once_all_are_waiting(*args, **kwargs):
        deadline = time.monotonic() + 60  # only a safety net against a hang, never what passes the test
        while at_lock.value < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(cache_module, "fcntl", SimpleNamespace(flock=counting_flock, LOCK_EX=fcntl.LOCK_EX,
                                                               LOCK_UN=fcntl.LOCK_UN))
    monkeypatch.setattr(gpt_module, "build_gpt_indices", build_once_all_are_waiting)
    sizes = np.random.default_rng(0).integers(20, 200, 200)
    write_dataset(tmp_path / "d", sizes)
    cache = str(tmp_path / "cache")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(str(tmp_path / "d"), cache, barrier, results))
             for _ in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert at_lock.value == 3
    assert sorted(r[0] for r in got) == ["built", "loaded", "loaded"]
    assert got[0][1] == got[1][1] == got[2][1]
    entries = os.listdir(cache)
    assert len([e for e in entries if not e.endswith(".lock")]) == 1
    assert not [e for e in entries if ".tmp-" in e]


def test_mock_dataset_is_deterministic_and_well_formed():
    cfg = GPTDatasetConfig(seq_length=16, seed=1, mock=True, vocab_size=50, eod=49, eod_mask_loss=True)
    a, b = MockGPTDataset(10, cfg), MockGPTDataset(10, cfg)
    for i in range(10):
        x, y = a[i], b[i]
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
        assert x["tokens"].shape == (16,) and x["tokens"].max() < 50
        np.testing.assert_array_equal(x["tokens"][1:], x["labels"][:-1])
    assert not np.array_equal(a[0]["tokens"], a[1]["tokens"])
    with pytest.raises(IndexError):
        a[10]
