"""tools/train_tokenizer.py's command line: malformed and unusual input (a bad line, pre-split
sentences, a lone surrogate escape, a byte order mark) and vocabulary sizes each model type cannot
take, refused in one line with exit code 2."""

import json

import pytest

from megatron_lite.data.tokenizers import build_tokenizer
from tests.tools import load_tool
from tests.unit.test_tokenizers import corpus_texts


def test_train_tokenizer_names_a_malformed_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello world"}\nnot json\n')
    assert load_tool("train_tokenizer").main(["--input", str(bad), "--output-prefix", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}:2:" in err[0]
    assert not list(tmp_path.glob("m*"))


def test_train_tokenizer_reads_presplit_sentences_as_preprocess_does(tmp_path, capsys):
    """A value that is a list of strings (a document's sentences, which preprocess_data.py accepts) is
    trained on; it was dropped silently, so such a corpus trained a tokenizer on nothing (byte-level
    BPE: no merge; WordPiece: the 5 special tokens; SentencePiece: an INTERNAL error)."""
    texts = corpus_texts()
    as_lists = tmp_path / "lists.jsonl"
    as_lists.write_text("".join(json.dumps({"text": t.split(". ")}) + "\n" for t in texts))
    as_text = tmp_path / "text.txt"
    as_text.write_text("".join(s + "\n" for t in texts for s in t.split(". ")))
    train = load_tool("train_tokenizer")
    for source, prefix in ((as_lists, "l"), (as_text, "t")):
        assert train.main(["--input", str(source), "--output-prefix", str(tmp_path / prefix), "--vocab-size", "400",
                           "--model-type", "wordpiece"]) == 0
    assert (tmp_path / "l-vocab.txt").read_text() == (tmp_path / "t-vocab.txt").read_text()
    assert len((tmp_path / "l-vocab.txt").read_text().split()) > 100  # 5 (the special tokens) before
    # a value preprocess_data.py refuses is refused here too, by file and line; no text at all is said
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": ["a", 3]}\n')
    assert train.main(["--input", str(bad), "--output-prefix", str(tmp_path / "b")]) == 2
    assert f"{bad}:2: value of 'text' is list, not a string or a list of strings" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": []}\n')
    assert train.main(["--input", str(empty), "--output-prefix", str(tmp_path / "e")]) == 2
    assert "no text to train on" in capsys.readouterr().err and not list(tmp_path.glob("[be]*.model"))


@pytest.mark.parametrize("model_type", ["bpe", "byte-level-bpe", "wordpiece"])
def test_train_tokenizer_takes_a_lone_surrogate_escape(tmp_path, capsys, model_type):
    """A JSONL line holding "\\ud83d" (valid JSON, half an emoji), which preprocess_data.py reads as
    U+FFFD: SentencePiece training failed with "Unable to cast Python instance ...", byte-level BPE
    with "'utf-8' codec can't encode character '\\ud83d'"."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts()) + '{"text": "half \\ud83d"}\n')
    code = load_tool("train_tokenizer").main(["--input", str(corpus), "--output-prefix", str(tmp_path / "m"),
                                              "--vocab-size", "700", "--model-type", model_type])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", ["bom.jsonl", "bom.txt"])
def test_train_tokenizer_skips_a_byte_order_mark(tmp_path, capsys, name):
    """A UTF-8 file starting with a byte-order mark (as Windows tools save it), which preprocess_data.py
    reads: its JSONL was refused ("Unexpected UTF-8 BOM"), its plain text began with the mark as a character."""
    corpus = tmp_path / name
    lines = [json.dumps({"text": t}) if name.endswith(".jsonl") else t for t in corpus_texts()]
    corpus.write_bytes(b"\xef\xbb\xbf" + "".join(line + "\r\n" for line in lines).encode("utf-8"))
    train = load_tool("train_tokenizer")
    assert next(train.read_texts(str(corpus))) == corpus_texts()[0]
    code = train.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "m"), "--vocab-size", "400",
                       "--model-type", "wordpiece"])
    assert code == 0, capsys.readouterr().err


def test_train_tokenizer_refuses_a_wordpiece_vocab_size_below_its_characters(tmp_path, capsys):
    """--model-type wordpiece --vocab-size 3 wrote a vocab of ~150 tokens without a word (the other
    model types refuse too small a --vocab-size); now it is refused in one line giving the minimum."""
    code, _, err = _train_cli(tmp_path, capsys, "--model-type", "wordpiece", "--vocab-size", "3")
    assert code == 2 and len(err) == 1 and "--vocab-size 3 is too small for wordpiece" in err[0]
    assert not list(tmp_path.glob("m*"))
    minimum = int(err[0].split(" take ")[1].split(";")[0])
    code, _, err = _train_cli(tmp_path, capsys, "--model-type", "wordpiece", "--vocab-size", str(minimum))
    assert code == 0 and len((tmp_path / "m-vocab.txt").read_text().split()) == minimum


def _train_cli(tmp_path, capsys, *argv):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts()))
    code = load_tool("train_tokenizer").main(["--input", str(corpus), "--output-prefix", str(tmp_path / "m"), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def test_sentencepiece_vocabulary_below_what_byte_fallback_needs_is_refused_up_front(tmp_path, capsys):
    """The minimum is said (3 special + 256 bytes + the corpus's distinct characters), nothing is
    written; exactly the minimum trains."""
    train = load_tool("train_tokenizer")
    minimum = train.sentencepiece_minimum(corpus_texts())
    code, _, err = _train_cli(tmp_path, capsys, "--vocab-size", "200")
    assert code == 2 and len(err) == 1 and f"needs at least {minimum} pieces" in err[0] and "INTERNAL" not in err[0]
    assert not list(tmp_path.glob("m*"))
    code, _, err = _train_cli(tmp_path, capsys, "--vocab-size", str(minimum - 1))
    assert code == 2 and f"needs at least {minimum}" in err[0]
    code, _, _ = _train_cli(tmp_path, capsys, "--vocab-size", str(minimum))
    assert code == 0 and build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "m.model")
                                         ).vocab_size == minimum
    code, _, err = _train_cli(tmp_path, capsys, "--vocab-size", "5000", "--model-type", "unigram")
    assert code == 2 and len(err) == 1 and "more than unigram can learn from this corpus (at most" in err[0]


def test_byte_level_bpe_below_257_is_refused_and_a_short_vocabulary_is_said(tmp_path, capsys):
    code, _, err = _train_cli(tmp_path, capsys, "--vocab-size", "200", "--model-type", "byte-level-bpe")
    assert code == 2 and len(err) == 1 and "256 byte symbols and <|endoftext|> take 257" in err[0]
    assert not list(tmp_path.glob("m*"))
    code, out, _ = _train_cli(tmp_path, capsys, "--vocab-size", "100000", "--model-type", "byte-level-bpe")
    assert code == 0 and "not --vocab-size 100000: no further pair occurs --min-frequency times" in out


def test_damaged_gzip_input_or_an_unwritable_output_is_one_line(tmp_path, capsys):
    """A .gz cut short (EOFError), a file named .gz that is not gzip (BadGzipFile) and an --output-prefix under
    a file (FileExistsError) were tracebacks (exit 1); now one line naming the file or flag, exit 2."""
    import gzip

    data = "".join(json.dumps({"text": f"word{i} and more text"}) + "\n" for i in range(3000)).encode()
    packed = gzip.compress(data)
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    (tmp_path / "plain.jsonl.gz").write_bytes(data)
    (tmp_path / "afile").write_text("")
    (tmp_path / "ok.jsonl").write_bytes(data)
    train = load_tool("train_tokenizer")
    for source, prefix, words in (("cut.jsonl.gz", "m", ("cut.jsonl.gz", "damaged")),
                                  ("plain.jsonl.gz", "m", ("plain.jsonl.gz", "not gzip")),
                                  ("ok.jsonl", "afile/m", ("--output-prefix", "afile/m"))):
        argv = ["--input", str(tmp_path / source), "--output-prefix", str(tmp_path / prefix), "--vocab-size", "300"]
        assert train.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not list(tmp_path.glob("m*"))


def test_a_bz2_or_misnamed_gzip_corpus_is_named_as_compressed(tmp_path, capsys):
    """Only .gz is decompressed: a corpus.jsonl.bz2 (read as plain text by its name) or gzip data in a file
    named .jsonl said 'not UTF-8 text ...; convert it to UTF-8', the wrong fix; the line now names the
    compression and the command that decompresses it (or the rename to .gz)."""
    import bz2
    import gzip

    data = "".join(json.dumps({"text": f"word{i} and more text"}) + "\n" for i in range(300)).encode()
    (tmp_path / "corpus.jsonl.bz2").write_bytes(bz2.compress(data))
    (tmp_path / "packed.jsonl").write_bytes(gzip.compress(data))
    train = load_tool("train_tokenizer")
    for source, words in (("corpus.jsonl.bz2", ("bzip2-compressed", f"bzip2 -dc {tmp_path}/corpus.jsonl.bz2 > "
                                                                     f"{tmp_path}/corpus.jsonl")),
                          ("packed.jsonl", ("gzip-compressed", "ends in .gz"))):
        argv = ["--input", str(tmp_path / source), "--output-prefix", str(tmp_path / "m"), "--vocab-size", "300"]
        assert train.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words) and "convert it to UTF-8" not in err[0], err
    assert not list(tmp_path.glob("m*"))
