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


def write_tiktoken_vocab(path, words=(), corpus=(), limit=200):
    """A TikTokenizer vocabulary file (a JSON list of {rank, token_bytes, token_str}): the 256 bytes, then
    every prefix (2 bytes and up) of ``words`` and of the ``limit`` commonest words of ``corpus`` (each
    with its leading space), so tiktoken's merges reach each whole word. Returns the number of tokens."""
    import base64
    from collections import Counter

    common = Counter(" " + w for text in corpus for w in text.split())
    tokens = {bytes([i]): None for i in range(256)}
    for word in [*words, *(w for w, _ in common.most_common(limit))]:
        raw = word.encode("utf-8")
        tokens.update({raw[:k]: None for k in range(2, len(raw) + 1)})
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
                "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    return len(entries)
