"""GPT-2's byte-level BPE: encoder, decoder, and a small trainer for local vocab/merges files.

The algorithm is GPT-2's (Radford et al. 2019, and the released encoder):

1. Pre-tokenize with GPT-2's regex (contractions, letter runs, digit runs, punctuation runs, each
   optionally led by one space; whitespace runs keep their last space for the next word).
2. Map each word's UTF-8 bytes to printable unicode characters (``bytes_to_unicode``), so every
   byte string is a string of vocabulary symbols and no text is ever unknown.
3. Repeatedly merge the adjacent pair with the lowest merge rank (its line in merges.txt), all
   non-overlapping occurrences left to right, until no adjacent pair has a rank.
4. Look the resulting symbols up in vocab.json.

Speed comes from a per-word cache that maps the raw word straight to its token ids (natural text
repeats words, so most words skip steps 2-4), from looking a whole document's words up in one
C-level pass (``map`` + ``chain``), and from doing the byte mapping with one ``str.translate`` call.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from itertools import chain

import regex

from ..files import replaced_whole

# GPT-2's pre-tokenization pattern, unchanged (datasets must tokenize identically).
GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
END_OF_TEXT = "<|endoftext|>"
_MAX_CACHE = 1_000_000  # words; the cache is cleared when it grows past this (bounded memory)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map.

    Printable latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...) map to
    code points 256, 257, ... in byte order, so e.g. a space becomes "Ġ" (U+0120).
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    # Keep GPT-2's ordering (printable bytes first): vocab ids 0..255 follow this order.
    return {b: mapping[b] for b in printable + [b for b in range(256) if b not in printable]}


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}
# Translating latin-1-decoded UTF-8 bytes with these tables does the byte mapping in C.
_TO_SYMBOLS = {b: c for b, c in BYTE_ENCODER.items()}
_FROM_SYMBOLS = {ord(c): b for b, c in BYTE_ENCODER.items()}


def word_to_symbols(word: str) -> str:
    """The byte-level symbol string of a word (one symbol character per UTF-8 byte)."""
    return word.encode("utf-8").decode("latin-1").translate(_TO_SYMBOLS)


def symbols_to_bytes(symbols: str) -> bytes:
    return symbols.translate(_FROM_SYMBOLS).encode("latin-1")


def utf8_encodable(text: str) -> str:
    """The text with surrogate code points made encodable: a high+low pair written as two code points
    becomes its character, a lone surrogate (e.g. from a JSON ``"\\ud800"`` escape) becomes U+FFFD.
    Both GPT-2 encoders apply this (tiktoken does the same internally) instead of failing on them."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def apply_merges(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the lowest-ranked adjacent pair (every occurrence, left to right) until none is ranked."""
    while len(symbols) > 1:
        best_rank, best = None, None
        for pair in zip(symbols, symbols[1:]):
            rank = ranks.get(pair)
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best = rank, pair
        if best is None:
            break
        first, second = best
        merged, i, n = [], 0, len(symbols)
        while i < n:
            if i < n - 1 and symbols[i] == first and symbols[i + 1] == second:
                merged.append(first + second)
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return symbols


class GPT2BPE:
    """Byte-level BPE encoder/decoder from a vocab (symbol string -> id) and ranked merges."""

    def __init__(self, encoder: dict[str, int], merges: list[tuple[str, str]]):
        self.encoder = encoder
        self.decoder = {i: s for s, i in encoder.items()}
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_files(cls, vocab_file: str, merge_file: str) -> GPT2BPE:
        from megatron_lite.data.indexed_dataset import DataFileError

        try:
            with open(vocab_file, encoding="utf-8") as f:
                encoder = json.load(f)
        except (OSError, ValueError) as e:
            raise DataFileError(f"{vocab_file}: cannot read GPT-2 vocab.json ({e})") from None
        if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
            raise DataFileError(f"{vocab_file}: expected a JSON object mapping tokens to integer ids")
        try:
            with open(merge_file, encoding="utf-8") as f:
                lines = f.read().split("\n")
        except (OSError, ValueError) as e:
            raise DataFileError(f"{merge_file}: cannot read GPT-2 merges.txt ({e})") from None
        merges = []
        for lineno, line in enumerate(lines, 1):
            if not line or line.startswith("#version"):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise DataFileError(f"{merge_file}:{lineno}: expected two space-separated symbols, "
                                    f"got {line!r}")
            merges.append((parts[0], parts[1]))
        if not merges and len(encoder) > len(BYTE_ENCODER) + 1:  # every text would be one token per byte
            raise DataFileError(f"{merge_file}: no merges, yet {vocab_file} has {len(encoder)} tokens (the 256 "
                                f"bytes and <|endoftext|> need none); give the merges.txt made with this vocab.json")
        missing = [c for c in BYTE_ENCODER.values() if c not in encoder]
        missing += [a + b for a, b in merges if a + b not in encoder]
        if missing:
            raise DataFileError(f"{vocab_file}: {len(missing)} byte symbols or merge results of "
                                f"{merge_file} are not in the vocabulary (first: {missing[0]!r}); "
                                f"the two files do not belong together")
        return cls(encoder, merges)

    def encode_word(self, word: str) -> tuple[int, ...]:
        """Token ids of one pre-tokenized word (and remember them in the cache)."""
        symbols = apply_merges(list(word_to_symbols(word)), self.ranks)
        ids = tuple(self.encoder[s] for s in symbols)
        self.cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        words = GPT2_PATTERN.findall(text)
        cache = self.cache
        if len(cache) >= _MAX_CACHE:
            cache.clear()
        try:  # the common case, every word cached: one C-level pass, no Python loop
            return list(chain.from_iterable(map(cache.__getitem__, words)))
        except KeyError:
            for word in set(words).difference(cache):
                self.encode_word(word)
            return list(chain.from_iterable(map(cache.__getitem__, words)))

    def decode(self, ids) -> str:
        symbols = "".join(self.decoder[int(i)] for i in ids)
        return symbols_to_bytes(symbols).decode("utf-8", errors="replace")


def pair_index(words: list[list[str]], freqs: list[int]):
    """For BPE-style training: the frequency of every adjacent symbol pair, the words holding each
    pair, and a max-heap (negated counts) of the pairs, to be updated as merges are applied."""
    pair_counts: dict[tuple[str, str], int] = defaultdict(int)
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for wi, syms in enumerate(words):
        for pair in zip(syms, syms[1:]):
            pair_counts[pair] += freqs[wi]
            where[pair].add(wi)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    return pair_counts, where, heap


def train_gpt2_bpe(texts, vocab_size: int, min_frequency: int = 2):
    """Learn GPT-2-style byte-level merges from an iterable of strings.

    Returns ``(encoder, merges)``: ids 0..255 are the byte symbols in GPT-2's order, then one id per
    merge, then ``<|endoftext|>`` last (as in GPT-2's own vocab).  Stops early when no pair occurs
    ``min_frequency`` times.  Ties between equally frequent pairs go to the smaller pair (sorted
    order), so training is deterministic.  Pair counts are updated incrementally: each merge only
    revisits the words that contain the merged pair.
    """
    word_counts: Counter[str] = Counter()
    for text in texts:
        word_counts.update(GPT2_PATTERN.findall(text))
    words = [list(word_to_symbols(w)) for w in word_counts]
    freqs = list(word_counts.values())
    pair_counts, where, heap = pair_index(words, freqs)
    merges: list[tuple[str, str]] = []
    num_merges = vocab_size - 256 - 1
    while heap and len(merges) < num_merges:
        neg_count, pair = heapq.heappop(heap)
        count = pair_counts.get(pair, 0)
        if count != -neg_count:  # stale heap entry: re-queue with the current count
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        if count < min_frequency:
            break
        merges.append(pair)
        ranks = {pair: 0}
        for wi in sorted(where.pop(pair, ())):
            old, f = words[wi], freqs[wi]
            new = apply_merges(old, ranks)
            if len(new) == len(old):
                continue
            for p in zip(old, old[1:]):
                pair_counts[p] -= f
            touched = set()
            for p in zip(new, new[1:]):
                pair_counts[p] += f
                where[p].add(wi)
                touched.add(p)
            for p in touched:
                heapq.heappush(heap, (-pair_counts[p], p))
            words[wi] = new
        pair_counts.pop(pair, None)
    encoder = {c: i for i, c in enumerate(BYTE_ENCODER.values())}
    for a, b in merges:
        encoder.setdefault(a + b, len(encoder))
    encoder[END_OF_TEXT] = len(encoder)
    return encoder, merges


def save_vocab_and_merges(encoder: dict[str, int], merges, vocab_file: str, merge_file: str) -> None:
    """Write vocab.json and merges.txt in GPT-2's formats (written to temp names, then renamed)."""
    for path, write in (
        (vocab_file, lambda f: json.dump(encoder, f, ensure_ascii=True)),
        (merge_file, lambda f: f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))),
    ):
        with replaced_whole(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            write(f)
