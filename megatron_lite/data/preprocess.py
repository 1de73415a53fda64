"""JSONL -> Megatron ``.bin/.idx`` token files: the engine behind ``tools/preprocess_data.py``.

One call, ``preprocess(PreprocessConfig(...))``, does what Megatron's tool does and writes the same
bytes: for every line (a JSON object) and every ``--json-keys`` field, tokenize the text (whole, or
sentence by sentence with ``split_sentences``), optionally append EOD to the document's last
sequence, and append the document to ``{output_prefix}_{key}_{document|sentence}.bin/.idx``.

How it stays fast and safe:
  * Lines are read as bytes, in chunks (up to ``CHUNK_LINES`` lines / ``CHUNK_BYTES`` bytes), and a
    worker pool turns each chunk into flat token arrays; ``Pool.imap`` keeps chunks in input order,
    so 1 worker and N workers write byte-identical files.
  * At most ``4 * workers`` chunks are in flight (``worker_pool.ChunkGate`` throttles the feeder), so memory stays
    bounded however large the input is: the file is streamed, never loaded.
  * Outputs are written under temporary names and renamed only when everything succeeded; an
    error or Ctrl-C leaves no partial ``.bin/.idx``.
  * A value may be a string, or (as in Megatron) a list of strings taken as the document's
    sentences, one sequence each.
  * A malformed line stops the run with ``file:line: reason`` (``MalformedLineError``), or, with
    ``skip_malformed``, is counted and skipped.  Blank lines are ignored.
  * ``partitions > 1`` processes the input as that many partitions (round-robin lines, or
    contiguous ranges with ``keep_sequential_samples``) and merges them in order, as Megatron does.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from megatron_lite.data.indexed_dataset import DataFileError, best_dtype, building_together
from megatron_lite.data.input_paths import compressed_hint, not_an_input_file
from megatron_lite.data.interrupt import default_sigterm_in_worker
from megatron_lite.data.parquet_input import NOT_JSON, count_rows, is_parquet_input, read_parquet_chunks
from megatron_lite.data.sentence_split import build_splitter
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.data.worker_pool import ChunkGate, stop_pool

CHUNK_LINES = 256
CHUNK_BYTES = 1 << 20


class MalformedLineError(DataFileError):
    """A JSONL line that is not an object with a string under every --json-keys key."""


@dataclass
class PreprocessConfig:
    input: str                                  # JSONL file, optionally .gz
    output_prefix: str                          # outputs: {prefix}_{key}_{document|sentence}.bin/.idx
    tokenizer: dict                             # build_tokenizer keyword arguments
    json_keys: list = field(default_factory=lambda: ["text"])
    split_sentences: bool = False               # one sequence per sentence instead of per document
    keep_newlines: bool = False                 # keep newlines between sentences when splitting
    sentence_splitter: str = "builtin"          # builtin (no download) or nltk (punkt, if installed)
    lang: str = "english"                       # punkt language (nltk splitter only)
    append_eod: bool = False                    # add EOD to each document's last sequence
    workers: int = 1                            # tokenizer processes (1: in this process)
    partitions: int = 1                         # process the input as this many parts, then merge
    keep_sequential_samples: bool = False       # partitions are contiguous line ranges (not round-robin)
    skip_malformed: bool = False                # skip and count malformed lines instead of stopping
    log_interval: int = 1000                    # documents between log lines (when no progress bar)
    progress: bool | None = None                # tqdm bar: None = only when stderr is a terminal


@dataclass
class PreprocessResult:
    outputs: list               # the output prefixes written, one per json key
    documents: int = 0
    tokens: int = 0
    bytes: int = 0              # bytes of JSON lines read
    skipped: int = 0            # malformed lines skipped (skip_malformed)
    seconds: float = 0.0


# -- worker side -----------------------------------------------------------------------------------
_worker: dict = {}


def init_worker(cfg: PreprocessConfig) -> None:
    """Build the tokenizer and sentence splitter once per process."""
    tokenizer = build_tokenizer(**cfg.tokenizer)
    _worker.update(
        cfg=cfg,
        tokenizer=tokenizer,
        dtype=best_dtype(tokenizer.vocab_size),
        splitter=build_splitter(cfg.sentence_splitter, cfg.lang, cfg.keep_newlines)
        if cfg.split_sentences else None,
    )
    # Tokenizing allocates many small objects, which triggers Python's cyclic garbage collector;
    # each full collection walks every live object (a caller that imported torch has millions).
    # Freezing what exists now makes the collector skip it: up to 2x faster in practice.
    gc.freeze()


def init_pool_worker(cfg: PreprocessConfig) -> None:
    """Pool workers ignore Ctrl-C: the main process handles it (removes temp files, stops the pool).
    SIGTERM (``Pool.terminate``) ends a worker quietly, whatever handler the forked main process had."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    default_sigterm_in_worker()
    init_worker(cfg)


def _parse(line: bytes, keys) -> list[str]:
    """The texts under ``keys``; ValueError with the reason when the line is malformed."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"invalid JSON ({e})") from None
    except RecursionError:  # e.g. 50,000 nested brackets: a malformed line, not a crash
        raise ValueError("invalid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    texts = []
    for key in keys:
        if key not in obj:
            raise ValueError(f"missing key {key!r} (--json-keys)")
        value = obj[key]
        if isinstance(value, list):  # pre-split sentences, as Megatron accepts
            if not all(isinstance(v, str) for v in value):
                raise ValueError(f"value of {key!r} is a list that holds a non-string")
        elif not isinstance(value, str):
            kind = value[NOT_JSON] if isinstance(value, dict) and NOT_JSON in value else type(value).__name__
            raise ValueError(f"value of {key!r} is {kind}, not a string")
        texts.append(value)
    return texts


def encode_chunk(chunk):
    """(first line number, line step, lines) -> per-key (tokens, sequence lengths, sequences per doc) + stats."""
    first_lineno, step, lines = chunk
    cfg, tok, splitter = _worker["cfg"], _worker["tokenizer"], _worker["splitter"]
    keys = cfg.json_keys
    flat = [[] for _ in keys]
    seq_lens = [[] for _ in keys]
    per_doc = [[] for _ in keys]
    errors, docs, nbytes = [], 0, 0
    for n, line in enumerate(lines):
        lineno = first_lineno + n * step
        nbytes += len(line)
        if not line.strip():
            continue
        try:
            texts = _parse(line, keys)
            encoded = []
            for text in texts:
                ids, lens = [], []
                if isinstance(text, list):
                    pieces = text
                else:
                    pieces = splitter(text) if splitter else (text,)
                for piece in pieces:
                    piece_ids = tok.tokenize(piece)
                    if piece_ids:
                        ids.extend(piece_ids)
                        lens.append(len(piece_ids))
                if lens and cfg.append_eod:
                    ids.append(tok.eod)
                    lens[-1] += 1
                encoded.append((ids, lens))
        except ValueError as e:
            errors.append((lineno, str(e)))
            if not cfg.skip_malformed:
                break  # the main process stops at the first error; the rest is not needed
            continue
        docs += 1
        for k, (ids, lens) in enumerate(encoded):
            flat[k].extend(ids)
            seq_lens[k].extend(lens)
            per_doc[k].append(len(lens))
    dtype = _worker["dtype"]
    out = [(np.array(flat[k], dtype=dtype), np.array(seq_lens[k], dtype=np.int64),
            np.array(per_doc[k], dtype=np.int64)) for k in range(len(keys))]
    return out, errors, docs, nbytes


# -- main side ---------------------------------------------------------------------------------------
def _open(path: str):
    if not os.path.isfile(path):
        raise DataFileError(not_an_input_file(path))
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb", buffering=1 << 20)


@contextlib.contextmanager
def _input_errors(path: str):
    """A damaged .gz (bad deflate data, CRC mismatch, cut short) as one DataFileError naming the file."""
    try:
        yield
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        what = "truncated" if isinstance(e, EOFError) else "corrupt"
        raise DataFileError(f"{path}: compressed input is {what} ({e}); re-create or re-download it") from None


def not_jsonl_hint(path: str) -> str:
    """When line 1 is bad because the file is one JSON document (an array of objects, or an object printed
    over several lines) rather than JSONL: what the file is and the command that converts it; or because it
    is compressed in a way that is not read (compressed_hint)."""
    if is_parquet_input(path):
        return ""
    if not path.endswith(".gz") and (hint := compressed_hint(path)):
        return hint
    with _input_errors(path), _open(path) as f:
        first = f.readline(1 << 16).lstrip(b"\xef\xbb\xbf").strip()
    if first.startswith(b"["):
        what, jq = "a JSON array", "'.[]'"
    elif first.startswith(b"{") and not first.endswith(b"}"):
        what, jq = "a JSON object printed over several lines", "."
    else:
        return ""
    source = f"gzip -dc {path} | jq -c {jq}" if path.endswith(".gz") else f"jq -c {jq} {path}"
    return (f"; the file is {what}, but --input is JSONL (one object per line): convert it with "
            f"{source} > {path.removesuffix('.gz').rsplit('.', 1)[0]}_lines.jsonl")


def count_lines(path: str, keys=("text",)) -> int:
    if is_parquet_input(path):
        return count_rows(path, keys)
    n, last = 0, b"\n"
    with _input_errors(path), _open(path) as f:
        while block := f.read(1 << 24):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def read_chunks(path: str, start: int = 0, stop: int | None = None, step: int = 1, keys=("text",)):
    """Yield chunks ``(first line number, step, [lines])`` of the lines whose 0-based index is in
    ``range(start, stop, step)``; line numbers are 1-based, as in error messages. Parquet input
    (a file or a directory of them) is read row by row as the equivalent JSON lines."""
    if is_parquet_input(path):
        yield from read_parquet_chunks(path, keys, start, stop, step)
        return
    lines, first, size = [], None, 0
    with _input_errors(path), _open(path) as f:
        for i, line in enumerate(f):
            if stop is not None and i >= stop:
                break
            if i < start or (i - start) % step:
                continue
            if first is None:
                first = i + 1
            lines.append(line)
            size += len(line)
            if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
                yield first, step, lines
                lines, first, size = [], None, 0
    if lines:
        yield first, step, lines


class _Progress:
    """tqdm bar with docs/s and MB/s, or (no terminal) a log line every log_interval documents."""

    def __init__(self, cfg: PreprocessConfig, total_bytes):
        show = cfg.progress if cfg.progress is not None else sys.stderr.isatty()
        self.bar = None
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                            desc="preprocess", dynamic_ncols=True, mininterval=0.5)
        self.start, self.docs, self.bytes = time.time(), 0, 0
        self.log_interval, self.next_log = cfg.log_interval, cfg.log_interval

    def update(self, docs: int, nbytes: int) -> None:
        self.docs += docs
        self.bytes += nbytes
        elapsed = max(time.time() - self.start, 1e-9)
        rate = f"{self.docs / elapsed:,.0f} docs/s, {self.bytes / elapsed / 2**20:.2f} MB/s"
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(rate, refresh=False)
        elif self.log_interval > 0 and self.docs >= self.next_log:
            print(f"Processed {self.docs} documents ({rate}).", file=sys.stderr, flush=True)
            while self.next_log <= self.docs:
                self.next_log += self.log_interval

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_pass(cfg, pool, chunks, prefixes, dtype, result, progress, in_flight: int) -> None:
    """Tokenize ``chunks`` (in order) into one builder per json key at ``prefixes``."""
    with contextlib.ExitStack() as stack:
        builders = stack.enter_context(building_together([(p, dtype) for p in prefixes]))  # all outputs or none
        if pool is None:
            results = map(encode_chunk, chunks)
        else:
            gate = ChunkGate(chunks, in_flight)
            stack.callback(gate.stop)  # unblock the pool's feeder thread however we leave
            results = pool.imap(encode_chunk, gate, chunksize=1)
        for out, errors, docs, nbytes in results:
            if pool is not None:
                gate.done_one()
            for lineno, reason in errors:
                if not cfg.skip_malformed:
                    hint = not_jsonl_hint(cfg.input) if lineno == 1 else ""
                    raise MalformedLineError(f"{cfg.input}:{lineno}: {reason}{hint}")
                result.skipped += 1
            for builder, (tokens, lens, per_doc) in zip(builders, out):
                builder.add_documents(tokens, lens, per_doc)
            result.documents += docs
            result.tokens += sum(int(tokens.size) for tokens, _, _ in out)
            result.bytes += nbytes
            progress.update(docs, nbytes)


def output_prefixes(cfg: PreprocessConfig) -> list[str]:
    level = "sentence" if cfg.split_sentences else "document"
    return [f"{cfg.output_prefix}_{key}_{level}" for key in cfg.json_keys]


def preprocess(cfg: PreprocessConfig) -> PreprocessResult:
    """Run the whole conversion; see the module docstring.  Raises DataFileError for bad input."""
    if cfg.workers < 1 or cfg.partitions < 1:
        raise ValueError("--workers and --partitions must be at least 1")
    parquet = is_parquet_input(cfg.input)
    if not (parquet or os.path.isfile(cfg.input)):
        raise DataFileError(not_an_input_file(cfg.input))
    init_worker(cfg)  # in this process too: validates the tokenizer files before any work
    if cfg.append_eod and _worker["tokenizer"].eod is None:
        raise ValueError(f"--append-eod: tokenizer {cfg.tokenizer['tokenizer_type']} has no EOD token")
    dtype = _worker["dtype"]
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    try:  # before any work: a file standing where the folder should be is the user's to fix
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise DataFileError(f"--output-prefix {cfg.output_prefix}: cannot write the datasets there ({e})") from None
    prefixes = output_prefixes(cfg)
    result = PreprocessResult(outputs=prefixes)
    start = time.time()
    total = None if parquet or cfg.input.endswith(".gz") else os.path.getsize(cfg.input)
    progress = _Progress(cfg, total)
    pool = None
    try:
        if cfg.workers > 1:
            pool = multiprocessing.get_context().Pool(cfg.workers, initializer=init_pool_worker,
                                                      initargs=(cfg,))
        in_flight = 4 * cfg.workers
        if cfg.partitions == 1:
            _run_pass(cfg, pool, read_chunks(cfg.input, keys=cfg.json_keys), prefixes, dtype, result, progress,
                      in_flight)
        else:
            tmp_dir = tempfile.mkdtemp(prefix=".partitions.", dir=out_dir)
            try:
                part_prefixes = []
                for p, line_range in enumerate(partition_ranges(cfg)):
                    names = [os.path.join(tmp_dir, f"part{p}_{os.path.basename(x)}") for x in prefixes]
                    _run_pass(cfg, pool, read_chunks(cfg.input, *line_range, keys=cfg.json_keys), names, dtype, result,
                              progress, in_flight)
                    part_prefixes.append(names)
                with building_together([(x, dtype) for x in prefixes]) as merged:
                    for names in part_prefixes:
                        for builder, name in zip(merged, names):
                            builder.add_index(name)
            finally:
                shutil.rmtree(tmp_dir, ignore_errors=True)
    finally:
        if pool is not None:
            stop_pool(pool)
        progress.close()
        gc.unfreeze()  # give the caller's objects back to the collector
    result.seconds = time.time() - start
    return result


def partition_ranges(cfg: PreprocessConfig) -> list[tuple]:
    """(start, stop, step) of each partition's line indices, as Megatron splits the input:
    round-robin lines, or (keep_sequential_samples) contiguous ranges of about equal size."""
    n_parts = cfg.partitions
    if not cfg.keep_sequential_samples:
        return [(p, None, n_parts) for p in range(n_parts)]
    per = -(-count_lines(cfg.input, cfg.json_keys) // n_parts)
    return [(p * per, (p + 1) * per, 1) for p in range(n_parts)]
