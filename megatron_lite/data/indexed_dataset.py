"""Megatron's memory-mapped token files: ``<prefix>.bin`` (tokens) + ``<prefix>.idx`` (index).

The byte layout is Megatron-LM's "MMIDIDX" version 1 (``idx_format.py``), so datasets move both ways.

``IndexedDataset`` reads a pair without loading it (np.memmap; with ``mmap_bin=False``,
``--no-mmap-bin-files``, the .bin by seek and read per sequence instead), after checking every header field
and that the fields agree (``idx_format.read_index`` and ``check_pointers``), so a truncated, foreign or
byte-flipped file is one clear ``DataFileError`` instead of misaligned tokens later.  ``IndexedDatasetBuilder`` writes a pair under
temporary names and renames both into place only in ``finalize()``: an interrupted write never
leaves a half-written dataset behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from array import array

import numpy as np

from .idx_format import DataFileError, check_pointers, dtype_code, read_index, write_index
from .input_paths import file_not_prefix, folder_not_prefix

_COPY_CHUNK = 16 * 1024 * 1024  # bytes per read when appending another dataset's .bin


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype Megatron uses for this vocabulary: uint16 below 65500, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


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
                if os.path.isfile(path_prefix):  # the raw corpus (data/corpus.jsonl), not its tokens
                    raise DataFileError(file_not_prefix(path_prefix))
                raise DataFileError(f"{path}: file not found (expected a Megatron .bin/.idx pair "
                                    f"with prefix {path_prefix!r})")
        index = read_index(idx_path)
        self.dtype, self._idx = index.dtype, index.mapping
        self.sequence_lengths, self.sequence_pointers = index.sequence_lengths, index.sequence_pointers
        self.document_indices, self.sequence_modes = index.document_indices, index.sequence_modes
        bin_size = os.path.getsize(bin_path)
        # np.memmap cannot map an empty file; an empty dataset gets an empty array instead.
        # --no-mmap-bin-files: no mapping; each read seeks and reads its bytes (see get)
        if bin_size == 0 or not mmap_bin:
            self._bin = np.zeros(0, dtype=np.uint8)
        else:
            self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r")
        self._bin_path = bin_path
        check_pointers(idx_path, bin_path, bin_size, index)

    def __getstate__(self):
        # Pickle by path (e.g. to DataLoader workers under "spawn"): the receiver maps the files again.
        return {"path_prefix": self.path_prefix, "mmap_bin": self.mmap_bin}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"], state.get("mmap_bin", True))

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
        dtype_code(self.dtype)  # a dtype the format has no code for is refused before anything is written
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
        finalize_together([self])

    def _write_index(self) -> None:
        """Close the .bin and write the .idx, both still under temporary names."""
        self._bin.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise DataFileError(f"{self.path_prefix}: a sequence longer than 2^31-1 tokens cannot be "
                                f"stored in the .idx format")
        if self.sequence_modes is not None and len(self.sequence_modes) != lengths.size:
            raise DataFileError(f"{self.path_prefix}: {lengths.size - len(self.sequence_modes)} sequences "
                                "were added without a multimodal mode beside datasets that have them")
        directory = os.path.dirname(os.path.abspath(self.path_prefix))
        fd, self._tmp_idx = tempfile.mkstemp(prefix=f".{os.path.basename(self.path_prefix)}.",
                                             suffix=".idx.tmp", dir=directory)
        with os.fdopen(fd, "wb") as f:
            write_index(f, self.dtype, lengths, self.document_indices, self.sequence_modes)
        # mkstemp creates files readable only by the owner; give them normal permissions.
        umask = os.umask(0)
        os.umask(umask)
        for path in (self._tmp_bin, self._tmp_idx):
            os.chmod(path, 0o666 & ~umask)

    def _rename(self) -> None:
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


def finalize_together(builders) -> None:
    """Finalize several builders as one output (the json keys of one preprocessing run, an SFT dataset's
    tokens and loss mask): every .idx is written before any file is renamed into place, so an error or an
    interrupt while finalizing leaves none of them, rather than some new and the others missing or old."""
    builders = [b for b in builders if not b._done]
    try:
        for builder in builders:
            builder._write_index()
        for builder in builders:
            builder._rename()
    except BaseException:
        for builder in builders:
            builder.abort()
        raise


@contextlib.contextmanager
def building_together(specs):
    """``with building_together([(prefix, dtype), ...]) as builders:``: one IndexedDatasetBuilder per
    spec, finalized together (finalize_together) on a clean exit, all aborted on an exception."""
    builders = []
    try:
        for prefix, dtype in specs:
            builders.append(IndexedDatasetBuilder(prefix, dtype))
        yield builders
    except BaseException:
        for builder in builders:
            builder.abort()
        raise
    finalize_together(builders)
