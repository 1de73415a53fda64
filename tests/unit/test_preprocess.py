"""preprocess_data / merge_datasets / make_sample_corpus, run in-process on small fixtures."""

import gzip
import json
import multiprocessing.pool
import os
import threading

import numpy as np
import pytest

import megatron_lite.data.preprocess as pp
from megatron_lite.data.gpt2_bpe import save_vocab_and_merges, train_gpt2_bpe
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDataset, IndexedDatasetBuilder
from megatron_lite.data.sentence_split import split_sentences
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.data.wordpiece import basic_tokenize
from tests.tools import load_tool

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures")
CORPUS = os.path.join(FIXTURES, "tiny_corpus.jsonl")




def texts(path=CORPUS, key="text"):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[key] for line in f if line.strip()]


def file_bytes(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory):
    """Small locally trained tokenizer files: GPT-2 BPE, SentencePiece, and a WordPiece vocab."""
    d = tmp_path_factory.mktemp("tok")
    encoder, merges = train_gpt2_bpe(texts() * 2, vocab_size=600)
    save_vocab_and_merges(encoder, merges, str(d / "vocab.json"), str(d / "merges.txt"))
    sp = load_tool("train_tokenizer").train_sentencepiece(texts() * 2, str(d / "sp"), vocab_size=600)
    words = sorted({w for t in texts() for w in basic_tokenize(t, lower_case=True)})
    chars = sorted({c for w in words for c in w})
    wp = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars] + words[::2]
    (d / "vocab.txt").write_text("\n".join(dict.fromkeys(wp)) + "\n", encoding="utf-8")
    return {
        "GPT2BPETokenizer": dict(vocab_file=str(d / "vocab.json"), merge_file=str(d / "merges.txt")),
        "GPTSentencePieceTokenizer": dict(tokenizer_model=sp),
        "SentencePieceTokenizer": dict(tokenizer_model=sp),
        "BertWordPieceLowerCase": dict(vocab_file=str(d / "vocab.txt")),
    }


def run(tmp_path, tokenizer, name="out", input=CORPUS, **kw):
    cfg = pp.PreprocessConfig(input=input, output_prefix=str(tmp_path / name), tokenizer=tokenizer, **kw)
    return pp.preprocess(cfg)


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "GPTSentencePieceTokenizer", "SentencePieceTokenizer",
                                  "BertWordPieceLowerCase"])
def test_round_trip(tmp_path, tok_files, kind):
    spec = dict(tokenizer_type=kind, **tok_files[kind])
    append_eod = kind != "BertWordPieceLowerCase"
    result = run(tmp_path, spec, append_eod=append_eod)
    tok = build_tokenizer(**spec)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    docs = texts()
    assert result.documents == ds.num_documents() == len(docs)
    assert ds.dtype == np.uint16
    for d, text in enumerate(docs):
        seqs = ds.get_document(d)
        if not text:  # an empty text is a document with no sequences (as in Megatron)
            assert seqs == []
            continue
        (ids,) = seqs
        if append_eod:
            assert ids[-1] == tok.eod
            ids = ids[:-1]
        assert ids.tolist() == tok.tokenize(text)
        if kind == "BertWordPieceLowerCase":  # lossy by design: decoding is normalised and idempotent
            assert tok.tokenize(tok.detokenize(ids)) == ids.tolist()
        else:
            assert tok.detokenize(ids) == text


def test_null_and_huggingface_round_trip(tmp_path, tok_files):
    rows = [{"text": " ".join(str(i) for i in range(n, n + 7))} for n in range(0, 90, 9)]
    path = tmp_path / "ints.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(tmp_path, dict(tokenizer_type="NullTokenizer", vocab_size=100), input=str(path), append_eod=True)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [list(range(n, n + 7)) + [100] for n in range(0, 90, 9)]
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    files = tok_files["GPT2BPETokenizer"]
    hf = tokenizers.Tokenizer(models.BPE.from_file(files["vocab_file"], files["merge_file"]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.save(str(tmp_path / "tokenizer.json"))
    run(tmp_path, dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json")),
        name="hf", append_eod=True)
    run(tmp_path, dict(tokenizer_type="GPT2BPETokenizer", **files), name="gpt2", append_eod=True)
    assert file_bytes(str(tmp_path / "hf_text_document")) == file_bytes(str(tmp_path / "gpt2_text_document"))


def test_huggingface_ids_past_the_vocabulary_count_get_room(tmp_path):
    """A tokenizer.json whose ids leave a gap (5 tokens, one of them id 70000): its vocab_size covers
    the largest id, so preprocessing writes int32 and reads the id back (it took the count, 5: uint16,
    and the run ended in an OverflowError traceback; training refused id 70000 as outside the vocab)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    hf = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 70000}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    spec = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))
    assert build_tokenizer(**spec).vocab_size == 70001
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a c b"}\n')
    run(tmp_path, spec, input=str(path), append_eod=True)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    eod = build_tokenizer(**spec).eod
    assert ds.dtype == np.int32 and ds[0].tolist() == [1, 70000, 2, eod]


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


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer",
                                  "GPT2BPETokenizer", "BertWordPieceLowerCase"])
def test_a_lone_surrogate_escape_is_tokenized_as_u_fffd(tmp_path, tok_files, kind):
    """Valid JSON "\\ud83d" (an emoji cut in half, common in scraped text) is a lone surrogate: with
    SentencePiece it was a pybind11 RuntimeError, with a Hugging Face tokenizer a TypeError, a
    traceback either way. Every tokenizer now reads it as U+FFFD, as the GPT-2 encoders did."""
    if kind == "HuggingFaceTokenizer":
        tokenizers = pytest.importorskip("tokenizers")
        from tokenizers import models, pre_tokenizers

        files = tok_files["GPT2BPETokenizer"]
        hf = tokenizers.Tokenizer(models.BPE.from_file(files["vocab_file"], files["merge_file"]))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.save(str(tmp_path / "tokenizer.json"))
        spec = dict(tokenizer_type=kind, tokenizer_model=str(tmp_path / "tokenizer.json"))
    else:
        spec = dict(tokenizer_type=kind, **tok_files[kind])
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "smile \\ud83d here"}\n{"text": "pair \\ud83d\\ude00 ok"}\n')
    for workers in (1, 2):
        run(tmp_path, spec, name=f"w{workers}", input=str(path), workers=workers)
    ds = IndexedDataset(str(tmp_path / "w1_text_document"))
    tok = build_tokenizer(**spec)
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize("smile \ufffd here"), tok.tokenize("pair \U0001f600 ok")]
    assert file_bytes(str(tmp_path / "w2_text_document")) == file_bytes(str(tmp_path / "w1_text_document"))


def test_split_sentences_and_eod_on_last_sentence(tmp_path, tok_files):
    spec = dict(tokenizer_type="GPTSentencePieceTokenizer", **tok_files["GPTSentencePieceTokenizer"])
    run(tmp_path, spec, json_keys=["text", "title"], split_sentences=True, append_eod=True)
    tok = build_tokenizer(**spec)
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"out_{key}_sentence"))
        for d, text in enumerate(texts(key=key)):
            expected = [tok.tokenize(s) for s in split_sentences(text)]
            expected = [e for e in expected if e]
            if expected:
                expected[-1].append(tok.eod)
            assert [s.tolist() for s in ds.get_document(d)] == expected
    # Several documents really were split, and Dr./p.m. did not end a sentence.
    assert split_sentences(texts()[1]) == ["Dr. Smith went to Washington.", "He arrived at 3 p.m. on Monday!",
                                           "Did he stay?", "Yes."]
    assert split_sentences("日本語です。次の文。") == ["日本語です。", "次の文。"]
    assert split_sentences("One.\n\nTwo\n\nThree? four.") == ["One.", "Two", "Three? four."]
    text = "A b.\n\nC d!  E\nf.\n"
    assert "".join(split_sentences(text, keep_newlines=True)) == text


def test_workers_and_partitions_are_byte_identical(tmp_path, tok_files, monkeypatch):
    monkeypatch.setattr(pp, "CHUNK_LINES", 3)  # many chunks, so ordering across workers is exercised
    spec = dict(tokenizer_type="GPT2BPETokenizer", **tok_files["GPT2BPETokenizer"])
    one = run(tmp_path, spec, name="w1", append_eod=True, workers=1)
    run(tmp_path, spec, name="w2", append_eod=True, workers=2)
    run(tmp_path, spec, name="p3", append_eod=True, workers=2, partitions=3, keep_sequential_samples=True)
    ref = file_bytes(str(tmp_path / "w1_text_document"))
    assert file_bytes(str(tmp_path / "w2_text_document")) == ref
    assert file_bytes(str(tmp_path / "p3_text_document")) == ref
    assert one.documents == len(texts()) and one.bytes == os.path.getsize(CORPUS)
    # Round-robin partitions (Megatron's default) = the input reordered partition by partition.
    run(tmp_path, spec, name="rr", append_eod=True, partitions=3)
    lines = open(CORPUS, encoding="utf-8").readlines()
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(lines[p::3][i] for p in range(3) for i in range(len(lines[p::3]))),
                         encoding="utf-8")
    run(tmp_path, spec, name="re", input=str(reordered), append_eod=True)
    assert file_bytes(str(tmp_path / "rr_text_document")) == file_bytes(str(tmp_path / "re_text_document"))
    assert file_bytes(str(tmp_path / "rr_text_document")) != ref
    # gzip input gives the same output.
    with gzip.open(tmp_path / "in.jsonl.gz", "wb") as f:
        f.write(open(CORPUS, "rb").read())
    run(tmp_path, spec, name="gz", input=str(tmp_path / "in.jsonl.gz"), append_eod=True, workers=2)
    assert file_bytes(str(tmp_path / "gz_text_document")) == ref
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".") or "tmp" in n]
    assert leftovers == []


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


def test_merge_equals_single_build(tmp_path, tok_files):
    spec = dict(tokenizer_type="GPT2BPETokenizer", **tok_files["GPT2BPETokenizer"])
    lines = open(CORPUS, encoding="utf-8").readlines()
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, (lo, hi) in enumerate([(0, 5), (5, 6), (6, len(lines))]):
        (tmp_path / f"s{i}.jsonl").write_text("".join(lines[lo:hi]), encoding="utf-8")
        run(shards, spec, name=f"shard{i}", input=str(tmp_path / f"s{i}.jsonl"), append_eod=True)
    run(tmp_path, spec, name="single", append_eod=True)
    merge = load_tool("merge_datasets")
    assert merge.main(["--input", str(shards), "--output-prefix", str(tmp_path / "merged")]) == 0
    assert file_bytes(str(tmp_path / "merged")) == file_bytes(str(tmp_path / "single_text_document"))
    # A dataset of another dtype in the folder: a clear error naming both files.
    with IndexedDatasetBuilder(str(shards / "zz_int32"), np.int32) as b:
        b.add_document([1, 2], [2])
    with pytest.raises(DataFileError, match=r"zz_int32.idx: token dtype int32 differs from uint16 of .*shard0"):
        merge.merge_datasets(merge.find_datasets(str(shards)), str(tmp_path / "m2"))
    assert not os.path.exists(tmp_path / "m2.bin")


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


def test_sample_corpus_is_deterministic(tmp_path):
    make = load_tool("make_sample_corpus")
    n1, size1 = make.make_sample_corpus(str(tmp_path / "a.jsonl"), docstrings=False)
    n2, _ = make.make_sample_corpus(str(tmp_path / "b.jsonl"), docstrings=False)
    assert n1 == n2 > 100 and size1 > 300_000
    assert open(tmp_path / "a.jsonl", "rb").read() == open(tmp_path / "b.jsonl", "rb").read()
    docs = texts(str(tmp_path / "a.jsonl"))
    assert all(d.strip() for d in docs) and len(docs) == n1


def test_memory_is_bounded_by_chunks_in_flight(tmp_path, monkeypatch):
    """The pool is fed at most 4 * workers chunks ahead of what has been written (streaming)."""
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i % 7} {i % 5}"}) + "\n" for i in range(300)))
    monkeypatch.setattr(pp, "CHUNK_LINES", 1)
    produced, leads = [0], []
    real_read, real_add = pp.read_chunks, IndexedDatasetBuilder.add_documents

    def counting_read(*args, **kwargs):
        for chunk in real_read(*args, **kwargs):
            produced[0] += 1
            yield chunk

    def recording_add(self, *args):
        leads.append(produced[0] - len(leads))
        return real_add(self, *args)

    monkeypatch.setattr(pp, "read_chunks", counting_read)
    monkeypatch.setattr(IndexedDatasetBuilder, "add_documents", recording_add)
    result = run(tmp_path, dict(tokenizer_type="NullTokenizer", vocab_size=10), input=str(path), workers=2)
    assert result.documents == 300 and len(leads) == 300
    assert max(leads) <= 4 * 2 + 1


def test_list_values_are_presplit_sentences(tmp_path):
    path = tmp_path / "lists.jsonl"
    path.write_text('{"text": ["1 2", "", "3"]}\n{"text": []}\n{"text": "4 5"}\n')
    run(tmp_path, dict(tokenizer_type="NullTokenizer", vocab_size=10), input=str(path), append_eod=True)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    # Empty sentences are dropped; EOD goes on the last sentence; an empty list is an empty document.
    assert [[s.tolist() for s in ds.get_document(d)] for d in range(3)] == [[[1, 2], [3, 10]], [], [[4, 5, 10]]]


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
    monkeypatch.setattr(pp, "POOL_STOP_SECONDS", 0.5)
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
