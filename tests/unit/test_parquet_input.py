"""Parquet input to preprocessing: the same rows as Parquet (one file, or a directory of files with
several row groups) give byte-identical .bin/.idx to JSONL; bad Parquet input gives the JSONL path's
errors, naming the file or the row."""

import json
import os

import pytest

from megatron_lite.data.indexed_dataset import DataFileError
from megatron_lite.data.preprocess import MalformedLineError, PreprocessConfig, preprocess
from tests.tools import load_tool

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TOKENIZER = dict(tokenizer_type="NullTokenizer", vocab_size=50)
GPT2 = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "gpt2")


def _run(tmp_path, input, name, **kw):
    kw = dict(dict(tokenizer=TOKENIZER, append_eod=True, progress=False, log_interval=0), **kw)
    cfg = PreprocessConfig(input=str(input), output_prefix=str(tmp_path / name), **kw)
    result = preprocess(cfg)
    files = [open(f"{p}{ext}", "rb").read() for p in result.outputs for ext in (".bin", ".idx")]
    return result, files


def _write(records, path, row_group_size):
    pq.write_table(pa.Table.from_pylist(records), str(path), row_group_size=row_group_size)


def _records(n=700):
    return [{"id": i, "text": " ".join(str((i * 7 + j) % 40) for j in range(i % 13 + 1)),
             "title": f"{i % 9} {i % 4}"} for i in range(n)]


def _jsonl(records, path):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("workers, partitions, sequential", [(1, 1, False), (2, 1, False), (2, 3, True), (1, 2, False)])
def test_parquet_directory_equals_jsonl(tmp_path, workers, partitions, sequential):
    records = _records()
    _jsonl(records, tmp_path / "corpus.jsonl")
    d = tmp_path / "pq"
    d.mkdir()
    # three files of uneven sizes, with row groups that do not line up with the 256-row chunks
    for name, part, rg in (("b.parquet", records[300:650], 100), ("a.parquet", records[:300], 77),
                           ("c.parquet", records[650:], 1000)):
        _write(part, d / name, rg)
    (d / "notes.txt").write_text("not parquet: ignored")
    kw = dict(json_keys=["text", "title"], workers=workers, partitions=partitions,
              keep_sequential_samples=sequential)
    ref, ref_files = _run(tmp_path, tmp_path / "corpus.jsonl", "jsonl", **kw)
    got, got_files = _run(tmp_path, d, "parquet", **kw)
    assert ref.documents == got.documents == len(records)
    assert got_files == ref_files


def test_parquet_file_with_gpt2_bpe_equals_jsonl(tmp_path):
    """The sample corpus through GPT-2 BPE: one Parquet file, same bytes as the JSONL."""
    corpus = tmp_path / "corpus.jsonl"
    load_tool("make_sample_corpus").make_sample_corpus(str(corpus))
    records = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    _write(records, tmp_path / "corpus.parquet", 64)
    tok = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=os.path.join(GPT2, "vocab.json"),
               merge_file=os.path.join(GPT2, "merges.txt"))
    _, ref = _run(tmp_path, corpus, "jsonl", tokenizer=tok, workers=2)
    _, got = _run(tmp_path, tmp_path / "corpus.parquet", "parquet", tokenizer=tok, workers=2)
    assert got == ref


def test_missing_column_names_the_file_and_columns(tmp_path):
    _write(_records(5), tmp_path / "x.parquet", 10)
    with pytest.raises(DataFileError, match=r"x\.parquet: no column 'body' \(--json-keys\); its columns are id, text, title"):
        _run(tmp_path, tmp_path / "x.parquet", "out", json_keys=["body"])
    assert not list(tmp_path.glob("out*"))  # nothing half-written


def test_null_value_is_a_malformed_row(tmp_path):
    records = _records(10)
    records[6]["text"] = None
    _write(records, tmp_path / "x.parquet", 4)
    with pytest.raises(MalformedLineError, match=r"x\.parquet:7: value of 'text' is NoneType, not a string"):
        _run(tmp_path, tmp_path / "x.parquet", "out")
    assert not list(tmp_path.glob("out*"))
    result, _ = _run(tmp_path, tmp_path / "x.parquet", "out", skip_malformed=True)
    assert (result.documents, result.skipped) == (9, 1)


def test_not_parquet_is_a_clear_error(tmp_path):
    (tmp_path / "bad.parquet").write_text("hello")
    with pytest.raises(DataFileError, match=r"bad\.parquet: not a readable Parquet file"):
        _run(tmp_path, tmp_path / "bad.parquet", "out")
    with pytest.raises(DataFileError, match="input file not found"):
        _run(tmp_path, tmp_path / "missing.parquet", "out")


def test_binary_and_other_non_json_columns(tmp_path):
    """A binary column (text stored as bytes) is read as its UTF-8 text, the same bytes as a string
    column; a value JSON cannot hold (a date, non-UTF-8 bytes) is a malformed row naming its type.
    Both ended in "TypeError: Object of type bytes (date) is not JSON serializable" tracebacks."""
    import datetime

    records = _records(20)
    texts = [r["text"] for r in records]
    pq.write_table(pa.table({"text": pa.array(texts)}), str(tmp_path / "s.parquet"))
    pq.write_table(pa.table({"text": pa.array([t.encode() for t in texts], type=pa.large_binary())}),
                   str(tmp_path / "b.parquet"))
    assert _run(tmp_path, tmp_path / "b.parquet", "b")[1] == _run(tmp_path, tmp_path / "s.parquet", "s")[1]
    bad = [t.encode() for t in texts]
    bad[4] = b"\xff\xfe"
    pq.write_table(pa.table({"text": pa.array(bad, type=pa.binary())}), str(tmp_path / "x.parquet"))
    with pytest.raises(MalformedLineError, match=r"x\.parquet:5: value of 'text' is binary \(not UTF-8\), not a string"):
        _run(tmp_path, tmp_path / "x.parquet", "out")
    result, _ = _run(tmp_path, tmp_path / "x.parquet", "out", skip_malformed=True)
    assert (result.documents, result.skipped) == (19, 1)
    pq.write_table(pa.table({"text": pa.array([datetime.date(2020, 1, 2)])}), str(tmp_path / "d.parquet"))
    with pytest.raises(MalformedLineError, match=r"d\.parquet:1: value of 'text' is date, not a string"):
        _run(tmp_path, tmp_path / "d.parquet", "out2")
