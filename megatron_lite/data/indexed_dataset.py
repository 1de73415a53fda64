"""Megatron's memory-mapped token files: ``<prefix>.bin`` (tokens) + ``<prefix>.idx`` (index).

The byte layout is Megatron-LM's "MMIDIDX" version 1, so datasets move both ways:

    .idx  magic b"MMIDIDX\\x00\\x00" | uint64 version=1 | uint8 dtype code | uint64 S | uint64 D
          | int32[S] sequence lengths | int64[S] byte pointers into .bin | int64[D] document indices
          | (optional int8[S] sequence modes, written by multimodal builders: ``sequence_modes``)
    .bin  the token arrays of every sequence, concatenated, no header.

All integers are little-endian.  ``document_indices`` are sequence-index boundaries: document ``d``
owns sequences ``document_indices[d] : document_indices[d + 1]``; they start with 0 and (for a
finished dataset) end with S.

``IndexedDataset`` reads a pair without loading it (np.memmap; with ``mmap_bin=False``,
``--no-mmap-bin-files``, the .bin by seek and read per sequence instead), after checking every header field
and that the fields agree (each pointer is the previous one plus that sequence's length times the
token size, the last sequence ends exactly at the end of the .bin), so a truncated, foreign or
byte-flipped file is one clear ``DataFileError`` instead of misaligned tokens later.  ``IndexedDatasetBuilder`` writes a pair under
temporary names and renames both into place only in ``finalize()``: an interrupted write never
leaves a half-written dataset behind.
"""

from __future__ import annotations

import os
import struct
import tempfile
from array import array

import numpy as np

from .input_paths import folder_not_prefix

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

_COPY_CHUNK = 16 * 1024 * 1024  # bytes per read when appending another dataset's .bin


class DataFileError(ValueError):
    """A data file is missing, truncated or not what it claims to be (a user error, not a bug)."""


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype Megatron uses for this vocabulary: uint16 below 65500, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype) -> int:
    """The .idx code of a numpy dtype; DataFileError if Megatron's format has no code for it."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise DataFileError(f"dtype {dtype} cannot be stored in a .bin/.idx dataset "
                        f"(supported: {', '.join(np.dtype(t).name for t in DTYPE_CODES.values())})")


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDataset:
    """Read-only, memory-mapped view of one ``prefix.bin`` / ``prefix.idx`` pair.

    ``ds[i]`` is sequence ``i`` (a numpy array of ``ds.dtype``); ``ds.get(i, offset, length)`` a slice
    of it; ``ds.get_document(d)`` the list of sequences of document ``d``.
    """

    def __init__(self, path_prefix: str, mmap_bin: bool = True):
        self.path_prefix, self.mmap_bin = path_prefix, mmap_bin
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        if os.path.isdir(path_prefix):  # "data/" for "data/corpus_text_document": say so, and list the pairs
            raise DataFileError(folder_not_prefix(path_prefix))
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                stem, suffix = os.path.splitext(path_prefix)
                if suffix in (".bin", ".idx") and os.path.isfile(index_file_path(stem)):
                    raise DataFileError(f"{path}: file not found; {path_prefix!r} names a file of the pair: give "
                                        f"the prefix without {suffix}: {stem!r}")
                raise DataFileError(f"{path}: file not found (expected a Megatron .bin/.idx pair "
                                    f"with prefix {path_prefix!r})")
        self._read_index(idx_path, bin_path)
        bin_size = os.path.getsize(bin_path)
        # np.memmap cannot map an empty file; an empty dataset gets an empty array instead.
        # --no-mmap-bin-files: no mapping; each read seeks and reads its bytes (see get)
        if bin_size == 0 or not mmap_bin:
            self._bin = np.zeros(0, dtype=np.uint8)
        else:
            self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r")
        self._bin_path = bin_path
        self._check_pointers(bin_path, bin_size)

    def __getstate__(self):
        # Pickle by path (e.g. to DataLoader workers under "spawn"): the receiver maps the files again.
        return {"path_prefix": self.path_prefix, "mmap_bin": self.mmap_bin}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"], state.get("mmap_bin", True))

    # -- index parsing and validation ------------------------------------------------------------
    def _read_index(self, idx_path: str, bin_path: str) -> None:
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
        self.dtype = np.dtype(DTYPE_CODES[code])
        num_seq, num_doc_idx = struct.unpack("<QQ", header[18:34])
        expected = HEADER_SIZE + num_seq * 4 + num_seq * 8 + num_doc_idx * 8
        # Multimodal builders append one int8 mode per sequence (sequence_modes; None without them)
        if idx_size not in (expected, expected + num_seq):
            raise DataFileError(f"{idx_path}: size {idx_size} bytes does not match its header "
                                f"({num_seq} sequences, {num_doc_idx} document indices need {expected} "
                                f"bytes); the file is truncated or corrupt")
        if num_doc_idx < 1:
            raise DataFileError(f"{idx_path}: document index is empty (must start with 0)")
        self._idx = np.memmap(idx_path, dtype=np.uint8, mode="r") if idx_size else None
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx, dtype="<i4", count=num_seq, offset=off)
        off += num_seq * 4
        self.sequence_pointers = np.frombuffer(self._idx, dtype="<i8", count=num_seq, offset=off)
        off += num_seq * 8
        self.document_indices = np.frombuffer(self._idx, dtype="<i8", count=num_doc_idx, offset=off)
        has_modes = num_seq > 0 and idx_size == expected + num_seq
        self.sequence_modes = np.frombuffer(self._idx, dtype="i1", count=num_seq,
                                            offset=off + num_doc_idx * 8) if has_modes else None
        docs = self.document_indices
        if docs[0] != 0 or np.any(np.diff(docs) < 0) or docs[-1] > num_seq:
            raise DataFileError(f"{idx_path}: document indices must rise from 0 to at most the "
                                f"{num_seq} sequences; the index is corrupt")

    def _check_pointers(self, bin_path: str, bin_size: int) -> None:
        """The index's fields must agree with each other and with the .bin, checked vectorised at open:
        sequences are packed back to back from byte 0 (each pointer is the previous one plus that
        sequence's length times the token size: one cumulative sum), they fit in the .bin, the .bin
        size fits the dtype code, and not every sequence is empty. A byte flip in any field of the
        index fails one of these, instead of training on misaligned tokens."""
        idx_path = index_file_path(self.path_prefix)
        lengths = self.sequence_lengths
        if len(lengths) == 0:
            if bin_size:
                raise DataFileError(f"{bin_path}: {bin_size} bytes, but its index {idx_path} describes no sequence; "
                                    f"the .bin belongs to another .idx or the index is truncated")
            return
        pointers = self.sequence_pointers
        if lengths.min() < 0 or pointers.min() < 0:
            raise DataFileError(f"{idx_path}: negative sequence length or pointer; the index is corrupt")
        sizes = lengths.astype(np.int64) * self.dtype.itemsize
        ends = np.cumsum(sizes)
        starts = ends - sizes
        wrong = np.flatnonzero(pointers != starts)
        if wrong.size:
            lengths64 = lengths.astype(np.int64)
            for size in sorted({np.dtype(t).itemsize for t in DTYPE_CODES.values()} - {self.dtype.itemsize}):
                if np.array_equal(np.cumsum(lengths64 * size) - lengths64 * size, pointers):
                    raise DataFileError(f"{idx_path}: dtype code says {self.dtype.name} ({self.dtype.itemsize} "
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
            tokens = end // self.dtype.itemsize
            if any(tokens * np.dtype(t).itemsize == bin_size for t in DTYPE_CODES.values()):
                raise DataFileError(f"{idx_path}: dtype code says {self.dtype.name}, but the .bin size "
                                    f"{bin_size} fits {tokens} tokens of {bin_size // tokens} bytes; the index "
                                    f"is corrupt")
            raise DataFileError(f"{bin_path}: {bin_size} bytes, but the index describes {end}; the .bin "
                                f"belongs to another .idx or the index's lengths are damaged")

    # -- access ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx`` (to its end when length is None)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences")
        idx = int(idx) % n
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens {offset}:{offset + length} out of range for sequence {idx} "
                             f"of length {seq_len}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        if not self.mmap_bin:  # a file read (a copy) of just these tokens
            with open(self._bin_path, "rb", buffering=0) as f:
                f.seek(start)
                return np.frombuffer(f.read(length * self.dtype.itemsize), dtype=self.dtype, count=length)
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get_document(self, doc: int) -> list[np.ndarray]:
        """The sequences (sentences, or the single whole text) of document ``doc``."""
        if not 0 <= doc < self.num_documents():
            raise IndexError(f"document {doc} out of range for {self.num_documents()} documents")
        lo, hi = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        return [self.get(i) for i in range(lo, hi)]

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


class IndexedDatasetBuilder:
    """Write a ``.bin/.idx`` pair, sequence by sequence, under temporary names.

    Use ``add_item`` per sequence and ``end_document`` after each document (or ``add_document``
    for both at once), then ``finalize()``.  As a context manager it finalizes on a clean exit and
    deletes its temporary files on an exception, so nothing half-written is left behind.
    """

    def __init__(self, path_prefix: str, dtype=np.int32):
        self.path_prefix = path_prefix
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        directory = os.path.dirname(os.path.abspath(path_prefix))
        os.makedirs(directory, exist_ok=True)
        base = os.path.basename(path_prefix)
        fd, self._tmp_bin = tempfile.mkstemp(prefix=f".{base}.", suffix=".bin.tmp", dir=directory)
        self._bin = os.fdopen(fd, "wb", buffering=1 << 20)
        self._tmp_idx = None
        self.sequence_lengths = array("q")
        self.document_indices = array("q", [0])
        self.sequence_modes = None  # array("b") once a dataset with multimodal modes is added (add_index)
        self._done = False

    # -- writing ---------------------------------------------------------------------------------
    def add_item(self, tokens) -> None:
        """Append one sequence (a list or array of token ids)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(arr.size)

    def end_document(self) -> None:
        """Close the current document: every sequence since the last call belongs to it."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths) -> None:
        """Append a whole document: its flat tokens and the lengths of its sequences."""
        arr = np.asarray(tokens, dtype=self.dtype)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != arr.size:
            raise ValueError(f"add_document: lengths sum to {sum(lengths)} but {arr.size} tokens given")
        self._bin.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.end_document()

    def add_documents(self, tokens, sequence_lengths, sequences_per_document) -> None:
        """Append many documents at once (a preprocessing chunk): flat tokens of all of them, every
        sequence's length, and how many sequences each document has (0 is allowed)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        if int(lengths.sum()) != arr.size:
            raise ValueError(f"add_documents: lengths sum to {int(lengths.sum())} but {arr.size} "
                             f"tokens given")
        self._bin.write(arr.tobytes(order="C"))
        start = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths.tolist())
        ends = start + np.cumsum(np.asarray(sequences_per_document, dtype=np.int64))
        self.document_indices.extend(ends.tolist())

    def add_index(self, other_prefix: str) -> None:
        """Append every sequence and document of another dataset (same dtype), streaming its .bin."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise DataFileError(f"{index_file_path(other_prefix)}: dtype {other.dtype} differs from "
                                f"{self.dtype} of the dataset being written to {self.path_prefix}")
        offset = len(self.sequence_lengths)
        self._add_modes(other, other_prefix)
        self.sequence_lengths.extend(other.sequence_lengths.astype(np.int64).tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        start = 0  # an open dataset's sequences are packed from byte 0 to the end of its .bin
        remaining = int(other.sequence_lengths.astype(np.int64).sum()) * np.dtype(other.dtype).itemsize
        del other  # drop the memory maps before streaming the file
        with open(data_file_path(other_prefix), "rb") as src:
            src.seek(start)
            while remaining:
                chunk = src.read(min(_COPY_CHUNK, remaining))
                if not chunk:
                    raise DataFileError(f"{data_file_path(other_prefix)}: shorter than its index says")
                self._bin.write(chunk)
                remaining -= len(chunk)

    def _add_modes(self, other: IndexedDataset, other_prefix: str) -> None:
        """Carry ``other``'s multimodal sequence modes; mixing datasets with and without them is refused."""
        if other.sequence_modes is not None and self.sequence_modes is None and not len(self.sequence_lengths):
            self.sequence_modes = array("b")  # the first dataset added has modes: the output has them
        has = other.sequence_modes is not None
        if len(other.sequence_lengths) and has != (self.sequence_modes is not None):
            raise DataFileError(f"{index_file_path(other_prefix)}: {'has' if has else 'has no'} multimodal sequence modes "
                                f"(the optional int8 per sequence of the .idx); the datasets before it "
                                f"{'have none' if has else 'have them'}: merge only datasets of one kind")
        if other.sequence_modes is not None:
            self.sequence_modes.extend(other.sequence_modes.tolist())

    def finalize(self) -> None:
        """Write the .idx and rename both temporary files to ``prefix.bin`` / ``prefix.idx``."""
        if self._done:
            return
        try:
            self._write_index_and_rename()
        except BaseException:
            self.abort()
            raise

    def _write_index_and_rename(self) -> None:
        self._bin.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise DataFileError(f"{self.path_prefix}: a sequence longer than 2^31-1 tokens cannot be "
                                f"stored in the .idx format")
        pointers = np.zeros(lengths.size, dtype="<i8")
        if lengths.size > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        directory = os.path.dirname(os.path.abspath(self.path_prefix))
        fd, self._tmp_idx = tempfile.mkstemp(prefix=f".{os.path.basename(self.path_prefix)}.",
                                             suffix=".idx.tmp", dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", self._code))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.tobytes())
            f.write(np.frombuffer(self.document_indices, dtype=np.int64).astype("<i8").tobytes())
            if self.sequence_modes is not None:  # Megatron's multimodal modes, one int8 per sequence
                if len(self.sequence_modes) != lengths.size:
                    raise DataFileError(f"{self.path_prefix}: {lengths.size - len(self.sequence_modes)} sequences "
                                        "were added without a multimodal mode beside datasets that have them")
                f.write(np.frombuffer(self.sequence_modes, dtype=np.int8).tobytes())
        # mkstemp creates files readable only by the owner; give them normal permissions.
        umask = os.umask(0)
        os.umask(umask)
        for path in (self._tmp_bin, self._tmp_idx):
            os.chmod(path, 0o666 & ~umask)
        # .idx last: a present .idx means its .bin is complete.
        os.replace(self._tmp_bin, data_file_path(self.path_prefix))
        os.replace(self._tmp_idx, index_file_path(self.path_prefix))
        self._done = True

    def abort(self) -> None:
        """Remove the temporary files; nothing is written under the final names."""
        if self._done:
            return
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if path and os.path.exists(path):
                os.remove(path)
        self._done = True

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def __del__(self):
        # A builder dropped without finalize() (e.g. a crash outside a with block) cleans up.
        try:
            if not self._done:
                self.abort()
        except Exception:
            pass
