"""BERT's WordPiece tokenizer: a basic tokenizer, then greedy longest-match-first subwords.

Basic tokenization (Devlin et al. 2019, and the released BERT code's behaviour):
  * drop NUL, U+FFFD and control characters; every whitespace character becomes a space;
  * put spaces around CJK ideographs (each is its own word);
  * split on whitespace; optionally lower-case and strip accents (NFD, drop combining marks);
  * split every punctuation character off as its own token.
WordPiece: each word is covered left to right by the longest vocabulary entry that matches
(continuations carry a ``##`` prefix); a word that cannot be covered, or is longer than 100
characters, becomes ``[UNK]``.
"""

from __future__ import annotations

import heapq
import unicodedata
from collections import Counter

from ..files import replaced_whole
from .gpt2_bpe import pair_index

MAX_WORD_CHARS = 100


def load_vocab(vocab_file: str) -> dict[str, int]:
    """vocab.txt: one token per line, the id is the line number (0-based; the last one of a repeated token)."""
    from megatron_lite.data.indexed_dataset import DataFileError

    try:
        with open(vocab_file, encoding="utf-8") as f:
            tokens = [line.rstrip("\n") for line in f]
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(f"{vocab_file}: cannot read WordPiece vocab.txt ({e})") from None
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab[tok.strip()] = i  # a token listed twice: its last line, as Megatron's and Hugging Face's loaders
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]", "[MASK]", "[PAD]") if t not in vocab]
    if missing:
        raise DataFileError(f"{vocab_file}: WordPiece vocab lacks the special tokens {missing} "
                            f"(one token per line is expected)")
    return vocab


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    return ch not in "\t\n\r" and unicodedata.category(ch).startswith("C")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
    chars = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            chars.append(" ")
        elif _is_cjk(cp):
            chars.append(f" {ch} ")
        else:
            chars.append(ch)
    tokens = []
    for word in "".join(chars).split():
        if lower_case:
            word = unicodedata.normalize("NFD", word.lower())
            word = "".join(c for c in word if unicodedata.category(c) != "Mn")
        current = []
        for ch in word:
            if _is_punctuation(ch):
                if current:
                    tokens.append("".join(current))
                    current = []
                tokens.append(ch)
            else:
                current.append(ch)
        if current:
            tokens.append("".join(current))
    return tokens


def wordpiece(word: str, vocab: dict[str, int], unk: str = "[UNK]") -> list[str]:
    if len(word) > MAX_WORD_CHARS:
        return [unk]
    pieces, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                break
            end -= 1
        if end == start:
            return [unk]
        pieces.append(piece)
        start = end
    return pieces


class WordPieceTokenizer:
    def __init__(self, vocab_file: str, lower_case: bool):
        self.vocab = load_vocab(vocab_file)
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.lower_case = lower_case

    def tokens(self, text: str) -> list[str]:
        return [p for w in basic_tokenize(text, self.lower_case) for p in wordpiece(w, self.vocab)]

    def encode(self, text: str) -> list[int]:
        return [self.vocab[t] for t in self.tokens(text)]

    def decode(self, ids) -> str:
        """Tokens joined by spaces, with ``##`` continuations glued back onto their word. An id without
        a token (the first line of a token listed twice) reads as [UNK]."""
        text = " ".join(self.inv_vocab.get(int(i), "[UNK]") for i in ids)
        return text.replace(" ##", "").strip()


# ---------------------------------------------------------------------------------------------
# Training a vocab.txt (tools/train_tokenizer.py --model-type wordpiece).

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _merge_word(symbols: list[str], first: str, second: str) -> list[str]:
    """Every non-overlapping (first, second) pair, left to right, joined (the continuation's ## dropped)."""
    out, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
            out.append(first + second[2:])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def train_wordpiece(texts, vocab_size: int, lower_case: bool = True, min_frequency: int = 2) -> list[str]:
    """A WordPiece vocabulary (token list, id = position) learned from an iterable of strings.

    Words come from :func:`basic_tokenize` (so training sees exactly what tokenization will), each
    spelled as its first character followed by ``##``-prefixed continuation characters. Starting
    from the special tokens and every character seen, the most frequent adjacent pair of pieces is
    merged into a new piece (``un`` + ``##able`` -> ``unable``) until ``vocab_size`` tokens (more if
    the characters alone exceed it: every character seen stays coverable) or no pair occurs
    ``min_frequency`` times; ties go to the smaller pair, so training is deterministic. The
    tokenizer then covers words greedily by longest match, as BERT does. Pair counts are updated
    incrementally: each merge revisits only the words containing the pair.
    """
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(w for w in basic_tokenize(text, lower_case) if len(w) <= MAX_WORD_CHARS)
    words = [[w[0]] + ["##" + c for c in w[1:]] for w in counts]
    freqs = list(counts.values())
    vocab = list(SPECIAL_TOKENS) + sorted({s for w in words for s in w} - set(SPECIAL_TOKENS))
    known = set(vocab)
    pair_counts, where, heap = pair_index(words, freqs)
    while heap and len(vocab) < vocab_size:
        neg_count, pair = heapq.heappop(heap)
        count = pair_counts.get(pair, 0)
        if count != -neg_count:  # stale entry: re-queue with the current count
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        if count < min_frequency:
            break
        merged = pair[0] + pair[1][2:]
        if merged not in known:
            known.add(merged)
            vocab.append(merged)
        for wi in sorted(where.pop(pair, ())):
            old, f = words[wi], freqs[wi]
            new = _merge_word(old, *pair)
            for p in zip(old, old[1:]):
                pair_counts[p] -= f
            for p in set(zip(new, new[1:])):
                where[p].add(wi)
            for p in zip(new, new[1:]):
                pair_counts[p] += f
            for p in set(zip(new, new[1:])):
                heapq.heappush(heap, (-pair_counts[p], p))
            words[wi] = new
        pair_counts.pop(pair, None)
    return vocab


def save_vocab(vocab: list[str], path: str) -> None:
    """vocab.txt, one token per line (written under a temporary name, then renamed)."""
    with replaced_whole(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(f"{t}\n" for t in vocab))
