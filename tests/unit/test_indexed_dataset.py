"""The .bin/.idx reader and writer against a pair built by hand from Megatron's byte layout.

.idx (little-endian): magic ``MMIDIDX\\x00\\x00``, u64 version 1, u8 dtype code, u64 sequence count,
u64 document-index length, int32 sequence lengths, int64 byte pointers into .bin, int64 document
indices (sequence numbers where documents start, first 0, last = sequence count). .bin: the tokens."""

import os
import struct

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import (
    DataFileError,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
)

# Two documents: doc 0 = sentences [5, 6, 7] and [8]; doc 1 = one sentence [65535, 0].
SEQS = [[5, 6, 7], [8], [65535, 0]]
DOC_INDICES = [0, 2, 3]


def hand_made_pair(prefix, seqs=SEQS, doc_indices=DOC_INDICES, code=8, itemsize=2, fmt="<H"):
    """Write prefix.bin/.idx with struct only, field by field, in the layout of the module docstring."""
    with open(prefix + ".bin", "wb") as f:
        for seq in seqs:
            for tok in seq:
                f.write(struct.pack(fmt, tok))
    idx = b"MMIDIDX\x00\x00"
    idx += struct.pack("<Q", 1)  # version
    idx += struct.pack("<B", code)  # dtype code
    idx += struct.pack("<Q", len(seqs))
    idx += struct.pack("<Q", len(doc_indices))
    for seq in seqs:
        idx += struct.pack("<i", len(seq))
    pointer = 0
    for seq in seqs:
        idx += struct.pack("<q", pointer)
        pointer += len(seq) * itemsize
    for d in doc_indices:
        idx += struct.pack("<q", d)
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)


def read_bytes(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def test_reads_hand_made_pair(tmp_path):
    prefix = str(tmp_path / "hand")
    hand_made_pair(prefix)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    assert len(ds) == 3 and ds.num_documents() == 2
    assert [ds[i].tolist() for i in range(3)] == SEQS
    assert ds.sequence_lengths.tolist() == [3, 1, 2]
    assert ds.sequence_pointers.tolist() == [0, 6, 8]
    assert ds.document_indices.tolist() == DOC_INDICES
    assert [s.tolist() for s in ds.get_document(0)] == [[5, 6, 7], [8]]
    assert ds.get(0, offset=1).tolist() == [6, 7]
    assert ds.get(0, offset=1, length=1).tolist() == [6]
    assert ds[-1].tolist() == [65535, 0]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        ds[3]


@pytest.mark.parametrize("how", ["items", "documents"])
def test_builder_reproduces_hand_made_bytes(tmp_path, how):
    hand_made_pair(str(tmp_path / "hand"))
    prefix = str(tmp_path / "built")
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
        if how == "items":
            b.add_item(SEQS[0])
            b.add_item(np.array(SEQS[1]))
            b.end_document()
            b.add_item(SEQS[2])
            b.end_document()
        else:
            b.add_document(SEQS[0] + SEQS[1], [3, 1])
            b.add_document(SEQS[2], [2])
    assert read_bytes(prefix) == read_bytes(str(tmp_path / "hand"))
    assert sorted(os.listdir(tmp_path)) == ["built.bin", "built.idx", "hand.bin", "hand.idx"]


def test_int32_and_empty_dataset(tmp_path):
    prefix = str(tmp_path / "big")
    hand_made_pair(prefix, seqs=[[70000, 1]], doc_indices=[0, 1], code=4, itemsize=4, fmt="<i")
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and ds[0].tolist() == [70000, 1]
    with IndexedDatasetBuilder(str(tmp_path / "big2"), dtype=np.int32) as b:
        b.add_document([70000, 1], [2])
    assert read_bytes(str(tmp_path / "big2")) == read_bytes(prefix)
    with IndexedDatasetBuilder(str(tmp_path / "empty"), dtype=np.uint16):
        pass
    empty = IndexedDataset(str(tmp_path / "empty"))
    assert len(empty) == 0 and empty.num_documents() == 0
    # an index of no sequence beside a .bin holding tokens: the pair does not belong together
    (tmp_path / "empty.bin").write_bytes(b"\x01\x00\x02\x00")
    with pytest.raises(DataFileError, match=r"empty.bin: 4 bytes, but its index .*empty.idx describes no sequence"):
        IndexedDataset(str(tmp_path / "empty"))


def test_best_dtype():
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128256) == np.int32


def test_add_index_equals_single_build(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 60000, rng.integers(0, 9)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(20)]

    def build(prefix, documents):
        with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
            for doc in documents:
                for seq in doc:
                    b.add_item(seq)
                b.end_document()

    build(str(tmp_path / "all"), docs)
    build(str(tmp_path / "a"), docs[:7])
    build(str(tmp_path / "b"), docs[7:])
    with IndexedDatasetBuilder(str(tmp_path / "merged"), dtype=np.uint16) as b:
        b.add_index(str(tmp_path / "a"))
        b.add_index(str(tmp_path / "b"))
    assert read_bytes(str(tmp_path / "merged")) == read_bytes(str(tmp_path / "all"))


def test_add_index_dtype_mismatch(tmp_path):
    hand_made_pair(str(tmp_path / "u16"))
    with pytest.raises(DataFileError, match="u16.idx"):
        with IndexedDatasetBuilder(str(tmp_path / "out"), dtype=np.int32) as b:
            b.add_index(str(tmp_path / "u16"))
    assert sorted(os.listdir(tmp_path)) == ["u16.bin", "u16.idx"]


def test_exception_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "x"), dtype=np.uint16) as b:
            b.add_item([1, 2, 3])
            b.end_document()
            raise RuntimeError("simulated crash")
    assert os.listdir(tmp_path) == []


def _corrupt(prefix, idx_edit=None, bin_edit=None):
    for ext, edit in ((".idx", idx_edit), (".bin", bin_edit)):
        if edit is not None:
            data = bytearray(open(prefix + ext, "rb").read())
            open(prefix + ext, "wb").write(bytes(edit(data)))


def _set(offset, value):
    def edit(data):
        data[offset:offset + len(value)] = value
        return data
    return edit


@pytest.mark.parametrize("idx_edit,bin_edit,bad_file,message", [
    (_set(0, b"XXIDIDX\x00\x00"), None, ".idx", "magic"),
    (_set(9, struct.pack("<Q", 2)), None, ".idx", "version"),
    (_set(17, b"\x09"), None, ".idx", "dtype code"),
    (lambda d: d[:20], None, ".idx", "truncated"),
    (lambda d: d[:-8], None, ".idx", "does not match"),
    (_set(18, struct.pack("<Q", 4)), None, ".idx", "does not match"),
    (None, lambda d: d[:-2], ".bin", "truncated"),
    (_set(34 + 3 * 4 + 2 * 8, struct.pack("<q", 10)), None, ".idx", "starts at byte 10"),
    (None, lambda d: d + b"XY", ".bin", "the index describes"),
    (_set(17, b"\x01"), None, ".idx", "pointers step by 2 bytes per token"),
    (_set(34 + 3 * 4 + 3 * 8, struct.pack("<q", 1)), None, ".idx", "document indices"),
])
def test_corrupt_files_name_the_file(tmp_path, idx_edit, bin_edit, bad_file, message):
    prefix = str(tmp_path / "data")
    hand_made_pair(prefix)
    _corrupt(prefix, idx_edit, bin_edit)
    with pytest.raises(DataFileError, match=message) as err:
        IndexedDataset(prefix)
    assert str(err.value).startswith(prefix + bad_file)


def test_missing_file(tmp_path):
    with pytest.raises(DataFileError, match="nothere.idx: file not found"):
        IndexedDataset(str(tmp_path / "nothere"))


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_file_name_given_as_the_prefix_says_to_drop_its_suffix(tmp_path, suffix):
    """--data-path data/x_text_document.bin (the file, not the prefix): the message says the fix."""
    prefix = str(tmp_path / "hand")
    hand_made_pair(prefix)
    with pytest.raises(DataFileError, match=rf"give the prefix without \{suffix}: '{prefix}'$"):
        IndexedDataset(prefix + suffix)


def test_pickles_by_path(tmp_path):
    import pickle

    prefix = str(tmp_path / "hand")
    hand_made_pair(prefix)
    ds = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    assert len(pickle.dumps(IndexedDataset(prefix))) < 200 + len(prefix)
    assert [ds[i].tolist() for i in range(3)] == SEQS


def test_every_byte_flip_and_truncation_of_the_index_is_caught(tmp_path):
    """Corruption corpus: each byte of the .idx flipped three ways, each truncation of either file.
    Every damaged header, length or pointer is a DataFileError naming the file; a flipped document
    index is either refused or still describes the same token sequences (no misaligned tokens)."""
    prefix = str(tmp_path / "data")
    hand_made_pair(prefix)
    good_bin, good_idx = read_bytes(prefix)
    doc_region = len(good_idx) - len(DOC_INDICES) * 8
    silent = []
    for pos in range(len(good_idx)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(good_idx)
            damaged[pos] ^= mask
            open(prefix + ".idx", "wb").write(bytes(damaged))
            try:
                ds = IndexedDataset(prefix)
            except DataFileError as err:
                assert str(err).startswith(prefix), err
                continue
            silent.append(pos)
            assert [ds[i].tolist() for i in range(len(ds))] == SEQS, (pos, mask)
    assert all(pos >= doc_region for pos in silent), silent
    for name, good in ((".idx", good_idx), (".bin", good_bin)):
        for cut in range(len(good)):
            open(prefix + ".idx", "wb").write(good_idx if name == ".bin" else good[:cut])
            open(prefix + ".bin", "wb").write(good_bin if name == ".idx" else good[:cut])
            with pytest.raises(DataFileError) as err:
                IndexedDataset(prefix)
            assert str(err.value).startswith(prefix), err.value
        open(prefix + name, "wb").write(good)


@pytest.mark.parametrize("pointer", [2**63 - 1, 2**62, 2**40])
def test_huge_pointer_is_one_line_not_a_numpy_error(tmp_path, pointer):
    prefix = str(tmp_path / "data")
    hand_made_pair(prefix)
    _corrupt(prefix, _set(34 + 3 * 4 + 8, struct.pack("<q", pointer)))
    with pytest.raises(DataFileError, match="starts at byte"):
        IndexedDataset(prefix)


def test_dtype_code_against_the_bin_size_of_one_sequence(tmp_path):
    prefix = str(tmp_path / "data")
    hand_made_pair(prefix, seqs=[[1, 2, 3]], doc_indices=[0, 1])
    _corrupt(prefix, _set(17, b"\x01"))
    with pytest.raises(DataFileError, match="fits 3 tokens of 2 bytes"):
        IndexedDataset(prefix)


def test_all_empty_sequences_are_refused(tmp_path):
    prefix = str(tmp_path / "data")
    hand_made_pair(prefix, seqs=[[], []], doc_indices=[0, 2])
    with pytest.raises(DataFileError, match="all 2 sequences have length 0"):
        IndexedDataset(prefix)
