"""The byte layout of Megatron's ``.idx`` index, "MMIDIDX" version 1, and the checks that a pair keeps it.

    .idx  magic b"MMIDIDX\\x00\\x00" | uint64 version=1 | uint8 dtype code | uint64 S | uint64 D
          | int32[S] sequence lengths | int64[S] byte pointers into .bin | int64[D] document indices
          | (optional int8[S] sequence modes, written by multimodal builders: ``sequence_modes``)
    .bin  the token arrays of every sequence, concatenated, no header.

All integers are little-endian.  ``document_indices`` are sequence-index boundaries: document ``d``
owns sequences ``document_indices[d] : document_indices[d + 1]``; they start with 0 and (for a
finished dataset) end with S.

``read_index`` checks every header field and maps the arrays; ``check_pointers`` checks that the
arrays agree with each other and with the .bin (each pointer is the previous one plus that sequence's
length times the token size, the last sequence ends exactly at the end of the .bin), so a truncated,
foreign or byte-flipped file is one clear ``DataFileError`` instead of misaligned tokens later;
``write_index`` writes an index.  The reader and the writer are in ``indexed_dataset.py``.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # 9 magic + 8 version + 1 dtype code + 8 sequence count + 8 document count

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


class DataFileError(ValueError):
    """A data file is missing, truncated or not what it claims to be (a user error, not a bug)."""


def dtype_code(dtype) -> int:
    """The .idx code of a numpy dtype; DataFileError if Megatron's format has no code for it."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise DataFileError(f"dtype {dtype} cannot be stored in a .bin/.idx dataset "
                        f"(supported: {', '.join(np.dtype(t).name for t in DTYPE_CODES.values())})")


class IndexArrays(NamedTuple):
    """An index's token dtype and its arrays, views of ``mapping`` (None for an empty file)."""
    dtype: np.dtype
    mapping: np.memmap | None
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray
    sequence_modes: np.ndarray | None


def read_index(idx_path: str) -> IndexArrays:
    """Check the header of ``idx_path`` and that the file has the size it implies; map its arrays."""
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_SIZE)
    if len(header) < 9 and MAGIC.startswith(header):
        raise DataFileError(f"{idx_path}: truncated header ({idx_size} bytes, need {HEADER_SIZE})")
    if header[:9] != MAGIC:
        raise DataFileError(f"{idx_path}: not a Megatron MMIDIDX index (bad magic bytes "
                            f"{header[:9]!r}; expected {MAGIC!r})")
    if len(header) < HEADER_SIZE:
        raise DataFileError(f"{idx_path}: truncated header ({idx_size} bytes, need {HEADER_SIZE})")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != VERSION:
        raise DataFileError(f"{idx_path}: unsupported index version {version} (only version 1)")
    code = header[17]
    if code not in DTYPE_CODES:
        raise DataFileError(f"{idx_path}: unknown dtype code {code} (valid codes: "
                            f"{sorted(DTYPE_CODES)})")
    num_seq, num_doc_idx = struct.unpack("<QQ", header[18:34])
    expected = HEADER_SIZE + num_seq * 4 + num_seq * 8 + num_doc_idx * 8
    # Multimodal builders append one int8 mode per sequence (sequence_modes; None without them)
    if idx_size not in (expected, expected + num_seq):
        raise DataFileError(f"{idx_path}: size {idx_size} bytes does not match its header "
                            f"({num_seq} sequences, {num_doc_idx} document indices need {expected} "
                            f"bytes); the file is truncated or corrupt")
    if num_doc_idx < 1:
        raise DataFileError(f"{idx_path}: document index is empty (must start with 0)")
    mapping = np.memmap(idx_path, dtype=np.uint8, mode="r") if idx_size else None
    off = HEADER_SIZE
    lengths = np.frombuffer(mapping, dtype="<i4", count=num_seq, offset=off)
    off += num_seq * 4
    pointers = np.frombuffer(mapping, dtype="<i8", count=num_seq, offset=off)
    off += num_seq * 8
    docs = np.frombuffer(mapping, dtype="<i8", count=num_doc_idx, offset=off)
    has_modes = num_seq > 0 and idx_size == expected + num_seq
    modes = np.frombuffer(mapping, dtype="i1", count=num_seq, offset=off + num_doc_idx * 8) if has_modes else None
    if docs[0] != 0 or np.any(np.diff(docs) < 0) or docs[-1] > num_seq:
        raise DataFileError(f"{idx_path}: document indices must rise from 0 to at most the "
                            f"{num_seq} sequences; the index is corrupt")
    return IndexArrays(np.dtype(DTYPE_CODES[code]), mapping, lengths, pointers, docs, modes)


def check_pointers(idx_path: str, bin_path: str, bin_size: int, index: IndexArrays) -> None:
    """The index's fields must agree with each other and with the .bin, checked vectorised at open:
    sequences are packed back to back from byte 0 (each pointer is the previous one plus that
    sequence's length times the token size: one cumulative sum), they fit in the .bin, the .bin
    size fits the dtype code, and not every sequence is empty. A byte flip in any field of the
    index fails one of these, instead of training on misaligned tokens."""
    lengths, pointers, dtype = index.sequence_lengths, index.sequence_pointers, index.dtype
    if len(lengths) == 0:
        if bin_size:
            raise DataFileError(f"{bin_path}: {bin_size} bytes, but its index {idx_path} describes no sequence; "
                                f"the .bin belongs to another .idx or the index is truncated")
        return
    if lengths.min() < 0 or pointers.min() < 0:
        raise DataFileError(f"{idx_path}: negative sequence length or pointer; the index is corrupt")
    sizes = lengths.astype(np.int64) * dtype.itemsize
    ends = np.cumsum(sizes)
    starts = ends - sizes
    wrong = np.flatnonzero(pointers != starts)
    if wrong.size:
        lengths64 = lengths.astype(np.int64)
        for size in sorted({np.dtype(t).itemsize for t in DTYPE_CODES.values()} - {dtype.itemsize}):
            if np.array_equal(np.cumsum(lengths64 * size) - lengths64 * size, pointers):
                raise DataFileError(f"{idx_path}: dtype code says {dtype.name} ({dtype.itemsize} "
                                    f"bytes per token), but the pointers step by {size} bytes per token; "
                                    f"the index is corrupt")
        bad = int(wrong[0])
        raise DataFileError(f"{idx_path}: sequence {bad} starts at byte {int(pointers[bad])}, but the sequence "
                            f"lengths put it at byte {int(starts[bad])}; the index is corrupt")
    end = int(ends[-1])
    if end == 0:
        raise DataFileError(f"{idx_path}: all {len(lengths)} sequences have length 0; the index is corrupt")
    if bin_size < end:
        bad = int(np.argmax(ends > bin_size))
        raise DataFileError(f"{bin_path}: {bin_size} bytes, but sequence {bad} of the index ends at "
                            f"byte {int(ends[bad])}; the .bin is truncated or belongs to another .idx")
    if bin_size > end:
        tokens = end // dtype.itemsize
        if any(tokens * np.dtype(t).itemsize == bin_size for t in DTYPE_CODES.values()):
            raise DataFileError(f"{idx_path}: dtype code says {dtype.name}, but the .bin size "
                                f"{bin_size} fits {tokens} tokens of {bin_size // tokens} bytes; the index "
                                f"is corrupt")
        raise DataFileError(f"{bin_path}: {bin_size} bytes, but the index describes {end}; the .bin "
                            f"belongs to another .idx or the index's lengths are damaged")


def write_index(f, dtype: np.dtype, lengths: np.ndarray, document_indices: np.ndarray, sequence_modes=None) -> None:
    """Write the index of sequences of ``lengths`` tokens of ``dtype``, packed from byte 0 of the .bin,
    to the open binary file ``f``; ``sequence_modes`` (one int8 per sequence) only when not None."""
    pointers = np.zeros(lengths.size, dtype="<i8")
    if lengths.size > 1:
        np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    f.write(MAGIC)
    f.write(struct.pack("<Q", VERSION))
    f.write(struct.pack("<B", dtype_code(dtype)))
    f.write(struct.pack("<Q", lengths.size))
    f.write(struct.pack("<Q", len(document_indices)))
    f.write(lengths.astype("<i4").tobytes())
    f.write(pointers.tobytes())
    f.write(np.asarray(document_indices, dtype=np.int64).astype("<i8").tobytes())
    if sequence_modes is not None:  # Megatron's multimodal modes, one int8 per sequence
        f.write(np.asarray(sequence_modes, dtype=np.int8).tobytes())
