"""Megatron-LM's ``TikTokenizer``: a byte-level BPE vocabulary read from a JSON file, encoded by tiktoken.

The file (``--tokenizer-model``) is a JSON list of ``{"rank": i, "token_bytes": base64, "token_str": ...}``
in rank order (or an object holding that list under ``"vocab"``, as Mistral's tekken.json does; its
other entries are not read: the flags below decide the special tokens). Rank ``i`` is entry ``i``;
the first 256 entries are the single bytes ``0..255``, so any text can be encoded.

The ids are laid out as Megatron-LM lays them out:

* ``0 .. S-1`` are special tokens, ``S = --tiktoken-num-special-tokens`` (default 1000): the list
  ``--tiktoken-special-tokens`` (default ``<unk> <s> </s>``; it must hold those three), then fillers
  ``<SPECIAL_k>`` for ``k = len(list) .. S-1``;
* ``S .. V-1`` are the file's first ``V - S`` entries, rank ``r`` at id ``S + r``, with
  ``V = --vocab-size`` (default 131072, 2**17); the file must have at least ``V - S`` entries;
* ``unk``, ``bos``, ``eos`` are the ids of ``<unk> <s> </s>``; the end of document is ``</s>``; ``pad`` is
  ``<pad>``'s id if the list names one (else none).

``tokenize`` splits the text with the ``--tiktoken-pattern`` regex (``v1`` or ``v2``) and adds nothing:
a special token's text (``</s>``) in the input is ordinary text there, as in Megatron-LM; ``detokenize``
joins the ids' bytes (a special id gives its text) and decodes UTF-8, invalid bytes as U+FFFD.

tiktoken is an optional extra (``pip install megatron_lite[tiktoken]``), imported only here; without it
building this tokenizer is one ConfigError line naming the extra.
"""

from __future__ import annotations

import base64
import binascii
import json

from megatron_lite.data.idx_format import DataFileError
from megatron_lite.errors import ConfigError

PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
PATTERN_V2 = "|".join((
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+", rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*", r"\p{N}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"))
PATTERNS = {"v1": PATTERN_V1, "v2": PATTERN_V2}
DEFAULT_VOCAB_SIZE = 2**17
DEFAULT_NUM_SPECIAL_TOKENS = 1000
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def read_ranks(path: str, count: int, special: int = 0) -> dict[bytes, int]:
    """The first ``count`` entries of a TikTokenizer vocabulary file as ``{token bytes: rank}`` (``special``:
    the special tokens before them, for the message);
    DataFileError (one line naming the file) for anything else than that format."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataFileError(f"{path}: not a readable TikTokenizer vocabulary (JSON) file ({e})") from None
    if isinstance(vocab, dict) and isinstance(vocab.get("vocab"), list):  # tekken.json
        vocab = vocab["vocab"]
    if not isinstance(vocab, list):
        raise DataFileError(f"{path}: not a TikTokenizer vocabulary: expected a JSON list of "
                            '{"rank", "token_bytes", "token_str"} entries (or tekken.json\'s {"vocab": [...]})')
    if len(vocab) < count:
        raise DataFileError(f"{path}: {len(vocab)} tokens, fewer than the {count} --vocab-size {count + special} "
                            f"asks for after {special} special tokens; pass --vocab-size {len(vocab) + special} "
                            "(or less)")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:count]):
        if not isinstance(entry, dict) or entry.get("rank") != i or not isinstance(entry.get("token_bytes"), str):
            raise DataFileError(f"{path}: entry {i} is not {{\"rank\": {i}, \"token_bytes\": base64, ...}} "
                                f"(got {str(entry)[:60]})")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, ValueError):
            raise DataFileError(f"{path}: entry {i}: token_bytes is not base64") from None
        if (i < 256 and token != bytes([i])) or not token:
            raise DataFileError(f"{path}: entry {i} must be the single byte {i} (the first 256 tokens are the bytes)"
                                if i < 256 else f"{path}: entry {i} is empty")
        if token in ranks:
            raise DataFileError(f"{path}: entry {i} repeats the token of entry {ranks[token]}")
        ranks[token] = i
    return ranks


def special_token_list(special_tokens, num_special_tokens: int, vocab_size: int) -> list[str]:
    """The ``num_special_tokens`` special tokens in id order (the flags' list, then the fillers)."""
    tokens = list(special_tokens) if special_tokens else list(REQUIRED_SPECIAL_TOKENS)
    if len(set(tokens)) != len(tokens):
        raise ConfigError(f"--tiktoken-special-tokens {' '.join(tokens)}: a token is listed twice; list each once")
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise ConfigError(f"--tiktoken-special-tokens must include {' '.join(REQUIRED_SPECIAL_TOKENS)} "
                          f"(missing {' '.join(missing)}); add them")
    if not len(tokens) <= num_special_tokens < vocab_size:
        raise ConfigError(f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the {len(tokens)} "
                          f"special tokens listed and below --vocab-size {vocab_size}")
    if vocab_size - num_special_tokens < 256:
        raise ConfigError(f"--vocab-size {vocab_size} leaves {vocab_size - num_special_tokens} ids after the "
                          f"{num_special_tokens} special tokens; the 256 byte tokens need at least "
                          f"--vocab-size {num_special_tokens + 256}")
    fillers = [f"<SPECIAL_{k}>" for k in range(len(tokens), num_special_tokens)]
    clash = set(tokens) & set(fillers)
    if clash:
        raise ConfigError(f"--tiktoken-special-tokens: {sorted(clash)[0]} is the name of a filler token; rename it")
    return tokens + fillers


class TikTokenizer:
    """See the module docstring; the interface of ``tokenizers.Tokenizer`` (not imported: that module
    builds this one). ``vocab``: token bytes (special tokens: their text) -> id; ``inv_vocab``: id ->
    token text (invalid UTF-8 as U+FFFD)."""

    eod = pad = cls = sep = mask = bos = eos = unk = None

    def __init__(self, path: str, pattern: str | None, vocab_size: int | None = None,
                 num_special_tokens: int | None = None, special_tokens=None):
        if pattern not in PATTERNS:
            got = "it has no default" if pattern is None else f"got {pattern}"
            raise ConfigError(f"--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2 ({got}: Megatron-LM's two "
                              "splitting regexes, v2 also splitting at a lower-to-upper case change); add one")
        try:
            import tiktoken
        except ImportError:  # a ConfigError: one line (exit 2) from the tools and the training scripts alike
            raise ConfigError("--tokenizer-type TikTokenizer needs the optional 'tiktoken' package: pip install "
                              "tiktoken (or pip install megatron_lite[tiktoken])") from None
        self.vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        num = DEFAULT_NUM_SPECIAL_TOKENS if num_special_tokens is None else int(num_special_tokens)
        specials = {t: i for i, t in enumerate(special_token_list(special_tokens, num, self.vocab_size))}
        ranks = {t: r + num for t, r in read_ranks(path, self.vocab_size - num, num).items()}
        self.path, self.num_special_tokens = path, num
        self.unk, self.bos, self.eos = (specials[t] for t in REQUIRED_SPECIAL_TOKENS)
        self.eod, self.pad = self.eos, specials.get("<pad>")
        self.encoding = tiktoken.Encoding("megatron_lite_tiktoken", pat_str=PATTERNS[pattern], mergeable_ranks=ranks,
                                          special_tokens=specials)
        self.vocab = {**ranks, **specials}
        self.inv_vocab = {i: t.decode("utf-8", errors="replace") for t, i in ranks.items()}
        self.inv_vocab.update({i: t for t, i in specials.items()})

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.encoding.encode_ordinary(text)  # (surrogate code points: tiktoken replaces them)
        return [self.bos] * bos + ids + [self.eos] * eos

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the TikTokenizer vocabulary [0, {self.vocab_size})")
        return self.encoding.decode(ids, errors="replace")
