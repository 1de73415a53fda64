"""preprocess_data / merge_datasets / make_sample_corpus, run in-process on small fixtures."""

import gzip
import json
import os

import numpy as np
import pytest

import megatron_lite.data.preprocess as pp
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDataset, IndexedDatasetBuilder
from megatron_lite.data.sentence_split import split_sentences
from megatron_lite.data.tokenizers import build_tokenizer
from tests.preprocess_helpers import CORPUS, file_bytes, make_tok_files, run, texts
from tests.tools import load_tool


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory):
    return make_tok_files(tmp_path_factory)


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
