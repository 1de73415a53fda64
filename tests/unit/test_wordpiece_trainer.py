"""The WordPiece vocab trainer (tools/train_tokenizer.py --model-type wordpiece)."""

import os
import subprocess
import sys

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.data.wordpiece import SPECIAL_TOKENS, basic_tokenize, train_wordpiece, wordpiece

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = ["The cat sat on the mat. The cats sat.", "Unbelievable! The mat is unbelievably flat.",
         "Cafe CAFÉ café"] * 3


def test_specials_first_and_size_respected():
    vocab = train_wordpiece(TEXTS, vocab_size=40, min_frequency=1)
    assert vocab[:5] == list(SPECIAL_TOKENS)
    assert len(vocab) == 40 and len(set(vocab)) == 40


def test_learns_frequent_words_and_covers_the_training_text():
    vocab = train_wordpiece(TEXTS, vocab_size=1000, min_frequency=2)
    index = {t: i for i, t in enumerate(vocab)}
    for word in ("the", "sat", "mat", "cafe"):  # frequent words become whole pieces (lower-cased, accents stripped)
        assert word in index, word
    assert "##s" in index  # continuations carry the ## prefix
    for text in TEXTS:
        for w in basic_tokenize(text, lower_case=True):
            assert wordpiece(w, index) != ["[UNK]"], w


def test_deterministic_and_cased_option():
    assert train_wordpiece(TEXTS, 60) == train_wordpiece(list(TEXTS), 60)
    assert "The" in train_wordpiece(TEXTS, 200, lower_case=False, min_frequency=2)


def test_cli_writes_a_vocab_the_bert_tokenizer_loads(tmp_path):
    corpus = os.path.join(ROOT, "tests", "fixtures", "tiny_corpus.jsonl")
    out = subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", corpus, "--output-prefix",
                          str(tmp_path / "wp"), "--model-type", "wordpiece", "--vocab-size", "200"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "BertWordPieceLowerCase" in out.stdout
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(tmp_path / "wp-vocab.txt"))
    assert tok.vocab_size == 200 and (tok.pad, tok.cls, tok.sep, tok.mask) == (0, 2, 3, 4)
    ids = tok.tokenize("The quick brown fox jumps over the lazy dog.")
    assert tok.detokenize(ids) == "the quick brown fox jumps over the lazy dog ."
