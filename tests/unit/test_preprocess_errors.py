"""preprocess_data / merge_datasets on bad input: malformed lines, unwritable outputs, damaged files,
interrupted runs, missing tokenizer data - one line naming the file or flag, nothing left half-written."""

import gzip
import json
import multiprocessing.pool
import os
import threading

import numpy as np
import pytest

import megatron_lite.data.preprocess as pp
import megatron_lite.data.worker_pool as worker_pool
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDataset, IndexedDatasetBuilder
from tests.preprocess_helpers import make_tok_files, run
from tests.tools import load_tool


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory):
    return make_tok_files(tmp_path_factory)


def test_a_text_the_huggingface_tokenizer_cannot_encode_names_the_line_and_the_tokenizer(tmp_path):
    """A BPE tokenizer.json whose unk_token is not in its vocabulary (a common training slip) raises a bare
    Rust Exception on an unseen character: that was a traceback from a worker; now a malformed line naming
    the tokenizer file (exit 2, or counted with --skip-malformed)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    hf = tokenizers.Tokenizer(models.BPE({"a": 0, "b": 1, "<|endoftext|>": 2}, [], unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    spec = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a b"}\n{"text": "a z b"}\n{"text": "b a"}\n')
    with pytest.raises(pp.MalformedLineError, match=f"in.jsonl:2: {tmp_path / 'tokenizer.json'} cannot encode"):
        run(tmp_path, spec, input=str(path))
    result = run(tmp_path, spec, input=str(path), skip_malformed=True)
    assert result.skipped == 1
    assert [x.tolist() for x in IndexedDataset(str(tmp_path / "out_text_document"))] == [[0, 1], [1, 0]]


BAD_LINES = ['{"text": "1 2"}', "{not json", '{"title": "no text key"}', '{"text": 5}', "", '["a list"]',
             '{"text": "3"}']


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_lines(tmp_path, workers, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(BAD_LINES) + "\n")
    spec = dict(tokenizer_type="NullTokenizer", vocab_size=10)
    with pytest.raises(pp.MalformedLineError, match=rf"^{path}:2: invalid JSON"):
        run(tmp_path, spec, input=str(path), workers=workers)
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing written
    # The CLI: one line "file:line: reason", exit code 2, no traceback.
    cli = load_tool("preprocess_data")
    path.write_text("\n".join(BAD_LINES[:1] + BAD_LINES[2:]) + "\n")
    code = cli.main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                     "NullTokenizer", "--vocab-size", "10", "--workers", str(workers)])
    err = capsys.readouterr().err
    assert code == 2 and err == f"{path}:2: missing key 'text' (--json-keys)\n"
    # --skip-malformed: bad lines are counted and skipped; the output equals the clean input's.
    path.write_text("\n".join(BAD_LINES) + "\n")
    result = run(tmp_path, spec, name="skip", input=str(path), skip_malformed=True, workers=workers)
    assert result.skipped == 4 and result.documents == 2
    ds = IndexedDataset(str(tmp_path / "skip_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3]] and ds.num_documents() == 2


def test_skip_counts_tokenizer_rejects_and_cli_report(tmp_path, capsys):
    path = tmp_path / "ints.jsonl"
    path.write_text('{"text": "1 2"}\n{"text": "3 x"}\n{"text": 4}\n{"text": "5"}\n{"text": ["6", 7]}\n')
    cli = load_tool("preprocess_data")
    code = cli.main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                     "NullTokenizer", "--vocab-size", "10", "--skip-malformed", "--append-eod"])
    out = capsys.readouterr().out
    assert code == 0 and "Skipped 3 malformed lines" in out
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 10], [5, 10]]


def _ctrl_c_at_third_chunk(monkeypatch) -> list:
    """Chunks of 4 lines; KeyboardInterrupt (what Ctrl-C raises) when the third chunk is written.
    Returns the list of writes, to be cleared between runs."""
    monkeypatch.setattr(pp, "CHUNK_LINES", 4)
    calls, real = [], IndexedDatasetBuilder.add_documents

    def crash_on_third(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(IndexedDatasetBuilder, "add_documents", crash_on_third)
    return calls


def test_interrupted_run_leaves_nothing(tmp_path, tok_files, monkeypatch):
    calls = _ctrl_c_at_third_chunk(monkeypatch)
    spec = dict(tokenizer_type="GPT2BPETokenizer", **tok_files["GPT2BPETokenizer"])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for workers, partitions in ((1, 1), (2, 1), (2, 2)):
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            run(out_dir, spec, workers=workers, partitions=partitions)
        assert len(calls) == 3 and os.listdir(out_dir) == []


def test_merge_into_an_unwritable_output_is_one_line(tmp_path, capsys):
    """An --output-prefix that cannot be written (here a file stands where its folder should be) is
    one line naming the flag, exit 2 (it was a FileExistsError traceback)."""
    shards = tmp_path / "shards"
    with IndexedDatasetBuilder(str(shards / "a"), np.uint16) as b:
        b.add_document([1, 2], [2])
    (tmp_path / "afile").write_text("")
    merge = load_tool("merge_datasets")
    assert merge.main(["--input", str(shards), "--output-prefix", str(tmp_path / "afile" / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"--output-prefix {tmp_path / 'afile' / 'm'}: cannot write"), err
    assert sorted(os.listdir(shards)) == ["a.bin", "a.idx"]


@pytest.mark.parametrize("partitions", ["1", "2"])
def test_preprocess_into_an_unwritable_output_is_one_line(tmp_path, capsys, partitions):
    """As merge_datasets.py: a file standing where --output-prefix's folder should be is one line naming
    the flag (it was 'error: [Errno 17] File exists: .../afile', naming neither the flag nor the fix)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "1 2 3"}\n')
    (tmp_path / "afile").write_text("")
    tool = load_tool("preprocess_data")
    out = str(tmp_path / "afile" / "sub" / "x")
    assert tool.main(["--input", str(src), "--output-prefix", out, "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "10", "--partitions", partitions, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"--output-prefix {out}: cannot write"), err


@pytest.mark.parametrize("workers", [1, 2])
def test_deeply_nested_json_is_a_malformed_line(tmp_path, workers, capsys):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "1 2"}\n{"text": ' + "[" * 50000 + "]" * 50000 + '}\n{"text": "3"}\n')
    cli = load_tool("preprocess_data")
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "10", "--workers", str(workers)]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"{path}:2: invalid JSON (nested too deeply)\n"
    assert os.listdir(tmp_path) == ["deep.jsonl"]
    assert cli.main(argv + ["--skip-malformed"]) == 0
    assert "Skipped 1 malformed lines" in capsys.readouterr().out


def _gz_corpus(path):
    import random

    rng = random.Random(0)
    texts = (" ".join(str(rng.randrange(10)) for _ in range(50)) for _ in range(400))
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    with gzip.open(path, "wb") as f:
        f.write(lines.encode())
    return path.read_bytes()


@pytest.mark.parametrize("damage, word", [
    (lambda d: d[: len(d) // 2], "truncated"),
    (lambda d: d[:60] + bytes(b ^ 0x5A for b in d[60:200]) + d[200:], "corrupt"),
    (lambda d: d[:-8] + bytes(b ^ 0xFF for b in d[-8:-4]) + d[-4:], "corrupt"),  # CRC mismatch
])
def test_damaged_gz_names_the_file(tmp_path, capsys, damage, word):
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(damage(_gz_corpus(path)))
    cli = load_tool("preprocess_data")
    code = cli.main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                     "NullTokenizer", "--vocab-size", "10"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"{path}: compressed input is {word}") and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == ["in.jsonl.gz"]  # nothing half-written


def test_a_pool_terminate_that_never_returns_does_not_hang_the_run(tmp_path, tok_files, monkeypatch):
    """CPython's Pool.terminate can wait forever for its task-feeding thread (a large task half
    written into a pipe no worker reads any more): the run still ends with its error, its workers
    terminated, nothing left on disk."""
    monkeypatch.setattr(worker_pool, "POOL_STOP_SECONDS", 0.5)
    real_terminate, stuck = multiprocessing.pool.Pool.terminate, []

    def terminate_then_hang(self):
        real_terminate(self)
        stuck.append(self)
        threading.Event().wait()  # as CPython's join of a blocked thread does

    monkeypatch.setattr(multiprocessing.pool.Pool, "terminate", terminate_then_hang)
    _ctrl_c_at_third_chunk(monkeypatch)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(KeyboardInterrupt):
        run(out_dir, dict(tokenizer_type="GPT2BPETokenizer", **tok_files["GPT2BPETokenizer"]), workers=2)
    assert len(stuck) == 1 and os.listdir(out_dir) == []
    assert not any(p.is_alive() for p in stuck[0]._pool)


def test_missing_nltk_data_names_the_package_this_nltk_loads(tmp_path, monkeypatch):
    """nltk >= 3.9 loads punkt_tab (not the punkt pickle) for 'tokenizers/punkt/english.pickle': the hint
    must name the package nltk itself is missing, or following it does not help."""
    nltk = pytest.importorskip("nltk")
    from megatron_lite.data.sentence_split import build_splitter

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    monkeypatch.delenv("NLTK_DATA", raising=False)
    with pytest.raises(LookupError) as missing:
        nltk.load("tokenizers/punkt/english.pickle")
    package = "punkt_tab" if "punkt_tab" in str(missing.value) else "punkt"
    with pytest.raises(ImportError, match=f"python -m nltk.downloader {package},"):
        build_splitter("nltk", "english")


def test_lang_with_the_builtin_splitter_is_refused(tmp_path, capsys):
    """--lang names punkt's language; the built-in splitter (the default) has English rules only, so
    --split-sentences --lang german split German text by English rules without a word."""
    gpt2 = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "gpt2")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "Das ist gut. Sehr gut."}\n')
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", os.path.join(gpt2, "vocab.json"), "--merge-file", os.path.join(gpt2, "merges.txt"),
            "--split-sentences", "--no-progress"]
    tool = load_tool("preprocess_data")
    assert tool.main(argv + ["--lang", "german"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--lang german needs --sentence-splitter nltk" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]
    assert tool.main(argv + ["--lang", "english"]) == 0 and (tmp_path / "o_text_sentence.idx").is_file()


@pytest.mark.parametrize("tool, kind", [("preprocess_data", "SentencePieceTokenizer"),
                                        ("preprocess_data", "BertWordPieceLowerCase"),
                                        ("preprocess_sft", "SentencePieceTokenizer")])
@pytest.mark.parametrize("value", [["3"], ["0"], []])
def test_vocab_extra_ids_is_refused_as_training_refuses_it(tmp_path, tok_files, capsys, tool, kind, value):
    """--vocab-extra-ids (T5's sentinel tokens) was taken with SentencePieceTokenizer, which appended
    <extra_id_N> ids, while pretrain_gpt.py / pretrain_bert.py refuse the flag: a dataset holding ids
    no training run's tokenizer has. The tools now refuse it with training's line, exit 2, no output."""
    from megatron_lite.megatron_flags import megatron_flag_message

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a b"}\n')
    files = [x for k, v in tok_files[kind].items() for x in (f"--{k.replace('_', '-')}", v)]
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", kind, *files,
            "--vocab-extra-ids", *value]
    with pytest.raises(SystemExit) as exit_:
        load_tool(tool).main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert megatron_flag_message("--vocab-extra-ids") in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_a_folder_or_a_pattern_as_input_says_what_input_takes(tmp_path):
    """A folder of JSONL shards or a quoted glob (Megatron-LM expands one with --partitions) was reported as
    'input file not found', though it exists; now one line says --input takes one file and how to join shards."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (shards / name).write_text(json.dumps({"text": "1 2"}) + "\n")
    spec = dict(tokenizer_type="NullTokenizer", vocab_size=10)
    out = tmp_path / "out"
    for given, words in ((shards, ("a folder without .parquet files",)),
                         (shards / "*.jsonl", ("a pattern (2 matches", "not expanded"))):
        with pytest.raises(DataFileError, match="--input takes one JSONL file") as err:
            run(out, spec, input=str(given))
        assert all(w in str(err.value) for w in words) and "merge_datasets" in str(err.value)
    with pytest.raises(DataFileError, match="input file not found"):
        run(out, spec, input=str(tmp_path / "none*.jsonl"))
    assert not out.exists()


@pytest.mark.parametrize("text,what", [('[{"text": "1 2"}, {"text": "3"}]\n', "a JSON array"),
                                       ('[\n  {"text": "1 2"},\n  {"text": "3"}\n]\n', "a JSON array"),
                                       ('{\n  "text": "1 2"\n}\n', "a JSON object printed over several lines")])
def test_a_json_file_that_is_not_jsonl_says_how_to_convert_it(tmp_path, text, what):
    """A .json export (an array of objects, or pretty-printed) failed on line 1 with 'expected a JSON object,
    got list' or a JSON syntax error, which does not say the file must be JSONL; now the line also says what
    the file is and gives the jq command that converts it."""
    src = tmp_path / "export.json"
    src.write_text(text)
    with pytest.raises(DataFileError, match=f"export.json:1: .*; the file is {what}, but --input is JSONL") as err:
        run(tmp_path / "out", dict(tokenizer_type="NullTokenizer", vocab_size=10), input=str(src))
    assert f"jq -c {'.' if 'object' in what else chr(39) + '.[]' + chr(39)} {src} > {tmp_path / 'export_lines.jsonl'}" \
        in str(err.value)
    assert list((tmp_path / "out").iterdir()) == []  # the output folder is made before the work, and left empty


def test_older_megatron_dataset_impl_mmap_is_accepted_and_other_formats_refused(tmp_path, capsys):
    """Older Megatron-LM preprocess commands (its README before 2023, Megatron-DeepSpeed) pass
    --dataset-impl mmap: that was argparse's 'unrecognized arguments', so the copied command did not
    run although mmap is the one format written. mmap is accepted and changes nothing (the same bytes);
    lazy and cached are refused in one line naming the flag, exit 2, nothing written."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1 2"}\n{"text": "3"}\n')
    cli = load_tool("preprocess_data")
    base = ["--input", str(path), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    assert cli.main(base + ["--output-prefix", str(tmp_path / "plain")]) == 0
    assert cli.main(base + ["--output-prefix", str(tmp_path / "mmap"), "--dataset-impl", "mmap"]) == 0
    for ext in (".bin", ".idx"):
        plain, mmap = (tmp_path / f"{p}_text_document{ext}" for p in ("plain", "mmap"))
        assert plain.read_bytes() == mmap.read_bytes()
    capsys.readouterr()
    for value in ("lazy", "cached"):
        with pytest.raises(SystemExit) as stop:
            cli.main(base + ["--output-prefix", str(tmp_path / value), "--dataset-impl", value])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and f"--dataset-impl: '{value}' is an older" in err
        assert not list(tmp_path.glob(f"{value}*"))


@pytest.mark.parametrize("name,head,what", [("in.jsonl.bz2", b"BZh91AY&SY\x90", "bzip2"),
                                            ("in.jsonl.zst", b"\x28\xb5\x2f\xfd\x00\x58", "zstd"),
                                            ("in.jsonl.xz", b"\xfd7zXZ\x00\x00", "xz"),
                                            ("in.jsonl", gzip.compress(b'{"text": "1"}\n'), "gzip")])
def test_compressed_input_other_than_gz_names_the_compression(tmp_path, name, head, what):
    """Only .gz is decompressed: a .bz2/.zst/.xz file, or gzip data in a file not named .gz, failed on line 1
    with 'invalid JSON (utf-8 codec can't decode byte 0x90...)', which does not say why; now the line
    names the compression and the fix (decompress it, or name a gzip file .gz)."""
    src = tmp_path / name
    src.write_bytes(head + b"\x00" * 16)
    with pytest.raises(DataFileError, match=f"{name}:1: .*; the file is {what}-compressed") as err:
        run(tmp_path / "out", dict(tokenizer_type="NullTokenizer", vocab_size=10), input=str(src))
    assert ("ends in .gz" if what == "gzip" else "decompress it") in str(err.value)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_corpus_of_only_empty_texts_warns_that_no_tokens_were_written(tmp_path, capsys):
    """Every text empty (or --json-keys naming a field that is empty) wrote a dataset of no tokens with
    'Done: 2 documents, 0 tokens' and exit 0, found out only when training refuses it; the tool still
    writes it (as Megatron-LM does) but says so on stderr, naming --json-keys."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "", "title": "1 2"}\n{"text": "", "title": "3"}\n')
    cli = load_tool("preprocess_data")
    base = ["--input", str(path), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    assert cli.main(base + ["--output-prefix", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: no tokens written" in err and "--json-keys" in err
    assert IndexedDataset(str(tmp_path / "a_text_document")).num_documents() == 2
    assert cli.main(base + ["--output-prefix", str(tmp_path / "b"), "--json-keys", "title"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_run_with_several_outputs_commits_all_or_none(tmp_path, monkeypatch):
    """Each output (a --json-keys field; an SFT dataset's tokens and loss mask) was finalized on its own, one
    after another: an error or an interrupt while writing a later .idx (disk full, Ctrl-C) left the earlier
    outputs renamed into place, so a re-run over an existing prefix left new titles beside old texts, or a
    new loss mask beside old tokens. Now every .idx is written before any rename: all outputs or none."""
    import megatron_lite.data.indexed_dataset as indexed
    from megatron_lite.data.sft_preprocess import preprocess_sft
    from tests.sft_helpers import write_conversations, write_tokenizer

    real, calls = indexed.write_index, []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "1 2", "title": "3"}\n{"text": "4", "title": "5 6"}\n')
    run(tmp_path, dict(tokenizer_type="NullTokenizer", vocab_size=10), input=str(src), json_keys=["text", "title"])
    before = {p.name: p.read_bytes() for p in tmp_path.glob("out_*")}
    src.write_text('{"text": "7", "title": "8 9"}\n')
    monkeypatch.setattr(indexed, "write_index", fail_second)
    with pytest.raises(OSError, match="No space"):
        run(tmp_path, dict(tokenizer_type="NullTokenizer", vocab_size=10), input=str(src), json_keys=["text", "title"])
    assert {p.name: p.read_bytes() for p in tmp_path.glob("out_*")} == before and len(before) == 4
    assert not list(tmp_path.glob(".*"))
    pytest.importorskip("tokenizers")
    jsonl, prefix, calls[:] = write_conversations(tmp_path / "chat.jsonl", 4), str(tmp_path / "sft" / "chat"), []
    with pytest.raises(OSError, match="No space"):
        preprocess_sft(jsonl, prefix, dict(tokenizer_type="HuggingFaceTokenizer",
                                           tokenizer_model=write_tokenizer(tmp_path / "tok")), progress=False)
    assert os.listdir(tmp_path / "sft") == []
