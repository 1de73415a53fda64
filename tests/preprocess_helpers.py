"""Shared by the preprocessing tests: the tiny corpus, locally trained tokenizer files, one run."""

import json
import os

import megatron_lite.data.preprocess as pp
from megatron_lite.data.gpt2_bpe import save_vocab_and_merges, train_gpt2_bpe
from megatron_lite.data.wordpiece import basic_tokenize
from tests.tools import load_tool

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
CORPUS = os.path.join(FIXTURES, "tiny_corpus.jsonl")


def texts(path=CORPUS, key="text"):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[key] for line in f if line.strip()]


def file_bytes(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def make_tok_files(tmp_path_factory):
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
