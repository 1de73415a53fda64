"""GPT2BPETokenizer on GPT-2's own vocabulary (tests/fixtures/gpt2: vocab.json and merges.txt, 50,257
tokens), and the tiktoken fast path against the pure-Python reference encoder on it.

Expected encodings are justified from the files themselves (which pieces the pre-tokenizer makes,
which of them are vocabulary entries, which merges exist); the ids are GPT-2's published ones.
"""

import os
import random
import unicodedata

import pytest
import regex

from megatron_lite.data.gpt2_bpe import GPT2_PATTERN, save_vocab_and_merges, train_gpt2_bpe, utf8_encodable
from megatron_lite.data.gpt2_fast import BACKEND_ENV, is_gpt2_vocabulary
from megatron_lite.data.preprocess import PreprocessConfig, preprocess
from megatron_lite.data.tokenizers import build_tokenizer
from tests.tools import load_tool

GPT2 = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "gpt2")
VOCAB, MERGES = os.path.join(GPT2, "vocab.json"), os.path.join(GPT2, "merges.txt")

ADVERSARIAL = [
    "", " ", "  ", "\n", "\n\n\n", "\t \t", "a\r\nb", "x" * 3000, " " * 50 + "end", "tail   ",
    "\u00a0nbsp\u3000ideographic\u2028line\u2029para\u200bzero-width",
    "I'm you're he's she'll we've they'd can't Y'ALL'RE 'S 's 't'",
    "curly \u2019s isn\u2019t a contraction for GPT-2's pattern",
    "0 12 123 1234 12345678901234567890 3.14159 -42 1e10 2,000 \u0663\u0664 \u00b2\u00b3 \u2167",
    "caf\u00e9 cafe\u0301 na\u00efve \u00c5ngstr\u00f6m \u2014 \u201cquotes\u201d \u2026 \u65e5\u672c\u8a9e "
    "\ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u05e2\u05d1\u05e8\u05d9\u05ea \u0939\u093f\u0928\u094d\u0926\u0940",
    "\U0001f642\U0001f680 \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7 \U0001f44d\U0001f3fd \u2764\ufe0f",
    "<|endoftext|> is ordinary text here <|endoftext|>",
    "\x00\x01 control \x7f bytes \x1b[31m",
    "def f(x):\n    return x**2  # comment\n\n\nclass A:\n\tpass\n",
    "!!!??? ... --- ___ $$$ @@@ ### %%% ^^^ &&& *** ((( ))) [[[ ]]] {{{ }}}",
    "URL https://example.com/a?b=c&d=e#f and e-mail a.b@c.de",
]
SURROGATES = ["lone high \ud800 here", "lone low \udc00", "reversed \udc00\ud800", "pair \ud83d\ude42 as two"]


def _tok():
    return build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)


@pytest.fixture(scope="module")
def both(request):
    """(tiktoken tokenizer, reference tokenizer) on GPT-2's vocabulary."""
    pytest.importorskip("tiktoken")
    fast = _tok()
    mp = pytest.MonkeyPatch()
    mp.setenv(BACKEND_ENV, "python")
    ref = _tok()
    mp.undo()
    assert (fast.backend, ref.backend) == ("tiktoken", "python")
    return fast, ref


def _merges():
    with open(MERGES, encoding="utf-8") as f:
        return {tuple(line.split(" ")) for line in f.read().split("\n")[1:] if line}


def test_vocabulary_shape():
    tok = _tok()
    assert tok.vocab_size == 50257 and tok.eod == 50256
    assert tok.vocab["!"] == 0 and tok.vocab["Ġ"] == 220  # byte symbols first, space = "Ġ"
    assert len(_merges()) == 50000


@pytest.mark.parametrize("backend", ["python", "auto"])
def test_known_encodings(monkeypatch, backend):
    monkeypatch.setenv(BACKEND_ENV, backend)
    tok, merges = _tok(), _merges()
    v = tok.vocab
    # Pre-tokenized into "Hello" and " world", each a single vocabulary entry.
    assert GPT2_PATTERN.findall("Hello world") == ["Hello", " world"]
    assert tok.tokenize("Hello world") == [v["Hello"], v["Ġworld"]] == [15496, 995]
    assert tok.tokenize(" the") == [v["Ġthe"]] == [262]
    # The contraction is its own piece; digit runs are pieces of at most what merges reach ("123", "456").
    assert tok.tokenize("I'm") == [v["I"], v["'m"]] == [40, 1101]
    assert tok.tokenize("123456") == [v["123"], v["456"]] == [10163, 29228]
    # GPT-2 has no merge of two spaces, so a run of spaces stays one "Ġ" (220) per space; the
    # whitespace rule leaves the last space to the next word.
    assert ("Ġ", "Ġ") not in merges
    assert GPT2_PATTERN.findall("   x") == ["  ", " x"]
    assert tok.tokenize("   x") == [220, 220, v["Ġx"]] == [220, 220, 2124]
    assert tok.tokenize("\n\n") == [v["ĊĊ"]] == [628]
    # "<|endoftext|>" written in text is ordinary text, never the end-of-document id 50256.
    assert tok.tokenize("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]
    # An emoji is 4 UTF-8 bytes F0 9F 99 82 -> symbols "ðŁĻĤ"; merges join them into two tokens.
    assert ("ð", "Ł") in merges and ("Ļ", "Ĥ") in merges and ("ðŁ", "ĻĤ") not in merges
    assert tok.tokenize("\U0001f642") == [v["ðŁ"], v["ĻĤ"]] == [8582, 25081]


def test_round_trips_on_adversarial_text():
    tok = _tok()
    for text in ADVERSARIAL:
        assert tok.detokenize(tok.tokenize(text)) == text, repr(text)


def test_surrogates_are_made_encodable(monkeypatch):
    """A lone surrogate (valid in JSON as an escape) encodes as U+FFFD, a pair given as two code
    points as its character, in both encoders; before, the reference encoder raised."""
    for backend in ("python", "auto"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        tok = _tok()
        assert tok.tokenize("a\ud800b") == tok.tokenize("a\ufffdb")
        assert tok.tokenize("pair \ud83d\ude42") == tok.tokenize("pair \U0001f642")
        for text in SURROGATES:
            assert tok.detokenize(tok.tokenize(text)) == utf8_encodable(text)


def _fuzz(n=400, seed=0):
    rng = random.Random(seed)
    pool = (list("aeiou xyzAEZ'sdmtlvre0123456789.,!?-_\t\n\r") + [" '", "'s", "'ll", "  "]
            + [chr(c) for c in (0xe9, 0x301, 0x4e2d, 0x1f642, 0x200d, 0x3000, 0xa0, 0x663, 0xd800, 0xdc00)])
    return ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 60))) for _ in range(n)]


def test_tiktoken_equals_reference_on_adversarial_text(both):
    fast, ref = both
    for text in ADVERSARIAL + SURROGATES + _fuzz() + ["".join(ADVERSARIAL)]:
        assert fast.tokenize(text) == ref.tokenize(text), repr(text)


def _probe(chars):
    """One text that puts each character next to letters, digits, spaces and a contraction."""
    return "".join(f"{c}a {c}1{c}  {c}'s{c}" for c in chars)


def test_tiktoken_equals_reference_across_unicode(both):
    """Every 11th assigned code point, in blocks (a block that differs would fail with its text)."""
    fast, ref = both
    chars = [chr(c) for c in range(0, 0x110000, 11) if unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    for i in range(0, len(chars), 256):
        text = _probe(chars[i:i + 256])
        assert fast.tokenize(text) == ref.tokenize(text), ascii(chars[i])


def test_characters_newer_than_this_pythons_unicode_take_the_reference(both):
    """Letters that the regex module knows but this Python's unicodedata does not assign are
    classified differently by tiktoken's Rust tables in some versions: such documents go to the
    reference encoder, so the ids still agree."""
    fast, ref = both
    newer = [chr(c) for c in range(0x32400) if unicodedata.category(chr(c)) == "Cn"  # planes 0-3
             and regex.match(r"\p{L}|\p{N}|\s", chr(c))]
    if not newer:
        pytest.skip("this Python's Unicode tables are as new as the regex module's")
    for c in newer[::max(1, len(newer) // 100)]:
        assert fast.tokenize(_probe([c])) == ref.tokenize(_probe([c])), ascii(c)


def test_tiktoken_equals_reference_on_the_sample_corpus(both):
    fast, ref = both
    corpus = load_tool("make_sample_corpus")
    texts = list(corpus.topic_texts()) + list(corpus.docstring_texts())
    docs = list(corpus.documents(texts, 2000))
    assert len(docs) > 400
    for doc in docs:
        assert fast.tokenize(doc) == ref.tokenize(doc)


def test_other_vocabularies_keep_the_reference_encoder(tmp_path):
    """tiktoken's merge rule is not GPT-2's in general: a locally trained vocabulary, or GPT-2's with
    two ids swapped, must use the reference encoder."""
    pytest.importorskip("tiktoken")
    encoder, merges = train_gpt2_bpe(["the quick brown fox jumps over the lazy dog"] * 3, 300, 1)
    save_vocab_and_merges(encoder, merges, str(tmp_path / "v.json"), str(tmp_path / "m.txt"))
    local = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"), merge_file=str(tmp_path / "m.txt"))
    assert local.backend == "python"
    tok = _tok()
    assert is_gpt2_vocabulary(tok.bpe)
    tok.bpe.encoder["Ġthe"], tok.bpe.encoder["Ġworld"] = 995, 262
    assert not is_gpt2_vocabulary(tok.bpe)


def test_preprocess_bytes_equal_with_either_encoder(tmp_path, monkeypatch):
    """tools/preprocess_data.py's core, 2 workers, the sample corpus: same .bin/.idx bytes."""
    pytest.importorskip("tiktoken")
    corpus = tmp_path / "corpus.jsonl"
    load_tool("make_sample_corpus").make_sample_corpus(str(corpus))
    outputs = {}
    for backend in ("python", "auto"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        prefix = str(tmp_path / backend)
        cfg = PreprocessConfig(input=str(corpus), output_prefix=prefix, append_eod=True, workers=2, progress=False,
                               log_interval=0, tokenizer=dict(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB,
                                                              merge_file=MERGES))
        result = preprocess(cfg)
        assert result.documents > 400
        outputs[backend] = [open(f"{prefix}_text_document{ext}", "rb").read() for ext in (".bin", ".idx")]
    assert outputs["python"] == outputs["auto"]


@pytest.mark.parametrize("content", ["", "#version: 0.2\n", "\n\n"])
def test_a_merges_file_without_merges_is_refused_for_a_vocabulary_that_needs_them(tmp_path, content):
    """An empty (or header-only) merges.txt beside GPT-2's 50,257-token vocab.json was accepted: every
    text then became one token per byte, the merged tokens never used; now refused naming the file."""
    from megatron_lite.data.indexed_dataset import DataFileError

    merges = tmp_path / "merges.txt"
    merges.write_text(content)
    with pytest.raises(DataFileError, match=f"{merges}: no merges, yet .*vocab.json has 50257 tokens"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=str(merges))
    encoder, _ = train_gpt2_bpe(["ab"], vocab_size=257, min_frequency=2)  # bytes and <|endoftext|>: no merges
    save_vocab_and_merges(encoder, [], str(tmp_path / "v.json"), str(merges))
    assert build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"), merge_file=str(merges)
                           ).tokenize("ab") == [encoder["a"], encoder["b"]]
