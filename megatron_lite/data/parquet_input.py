"""Parquet input for preprocessing: a ``.parquet`` file, or a directory of them, read as JSONL rows.

Large public corpora ship as Parquet. ``--input`` may name one Parquet file or a directory holding
``*.parquet`` files (taken in sorted name order, as one sequence of rows); ``--json-keys`` names the
columns. Each row's selected columns become exactly the JSON line ``{"col": value, ...}`` that the
JSONL path reads, so the rest of preprocessing (workers, malformed-row errors, ``--skip-malformed``,
partitions, temporary outputs renamed at the end) is shared, and a Parquet corpus gives the same
``.bin/.idx`` bytes as the same rows in JSONL. Rows are streamed: pyarrow reads one row group at a
time and hands out small record batches, so memory stays bounded. Needs the optional ``pyarrow``
package (``pip install megatron_lite[parquet]``). A malformed row is reported as ``input:row``, the
row counted from 1 over the whole input (all files), like a JSONL line number.
"""

from __future__ import annotations

import json
import os

from megatron_lite.data.indexed_dataset import DataFileError

BATCH_ROWS = 256  # rows per record batch, and per chunk handed to a worker (the JSONL chunk size)
# A value JSON cannot hold (a date, a decimal, binary that is not UTF-8) is written as {NOT_JSON: its type
# name}, so that the row is reported (or skipped) like any malformed row, naming that type.
NOT_JSON = "\u0000parquet type"


def _json_value(value):
    """json.dumps's fallback: a binary column's UTF-8 text as the string it holds, else the marker."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return {NOT_JSON: "binary (not UTF-8)"}
    return {NOT_JSON: type(value).__name__}


def is_parquet_input(path: str) -> bool:
    if os.path.isdir(path):
        return bool(parquet_files(path))
    return path.endswith(".parquet")


def parquet_files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
    return [path]


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataFileError("reading Parquet (--input *.parquet) needs the optional 'pyarrow' package: "
                            "pip install pyarrow  (or pip install megatron_lite[parquet])") from None
    return pq


def _open(pq, path: str, keys):
    if not os.path.isfile(path):
        raise DataFileError(f"{path}: input file not found (--input)")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for a file that is not Parquet
        raise DataFileError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    missing = [k for k in keys if k not in names]
    if missing:
        raise DataFileError(f"{path}: no column {missing[0]!r} (--json-keys); its columns are {', '.join(names)}")
    return pf


def count_rows(path: str, keys) -> int:
    pq = _pyarrow_parquet()
    return sum(_open(pq, f, keys).metadata.num_rows for f in parquet_files(path))


def _rows(path: str, keys):
    """Every row of every file, in order, as the JSON line (bytes) a JSONL corpus would hold."""
    pq = _pyarrow_parquet()
    for f in parquet_files(path):
        pf = _open(pq, f, keys)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=list(keys)):
            columns = [batch.column(k).to_pylist() for k in keys]
            for values in zip(*columns):
                yield json.dumps(dict(zip(keys, values)), ensure_ascii=False, default=_json_value).encode("utf-8") + b"\n"


def read_parquet_chunks(path: str, keys, start: int = 0, stop: int | None = None, step: int = 1):
    """Chunks ``(first row number, step, [JSON lines])`` of the rows whose 0-based index is in
    ``range(start, stop, step)``, as ``read_chunks`` yields lines of a JSONL file."""
    lines, first = [], None
    for i, line in enumerate(_rows(path, keys)):
        if stop is not None and i >= stop:
            break
        if i < start or (i - start) % step:
            continue
        if first is None:
            first = i + 1
        lines.append(line)
        if len(lines) >= BATCH_ROWS:
            yield first, step, lines
            lines, first = [], None
    if lines:
        yield first, step, lines
