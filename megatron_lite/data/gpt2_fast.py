"""GPT-2 BPE through tiktoken's compiled encoder, when tiktoken is installed (optional extra ``fast``).

The pure-Python encoder in :mod:`megatron_lite.data.gpt2_bpe` stays the reference and the fallback.
tiktoken is used only for GPT-2's own vocabulary (the 50,000 merges of GPT-2's merges.txt, checked by
hash, with token ids in merge order), because its algorithm is not GPT-2's in general: it joins the
adjacent pair whose *concatenation* has the lowest id, while GPT-2 joins the pair with the lowest
merge-rule rank. The two differ on a vocabulary where some token ``xy`` was created by another
split than ``(x, y)`` and that split can arise while encoding; on GPT-2's vocabulary OpenAI ships
tiktoken as GPT-2's encoder, and the tests compare both encoders on the sample corpus and on
adversarial text. Any other vocabulary (a locally trained one) keeps the reference encoder.

The two encoders also classify characters with different Unicode tables (the ``regex`` module's
versus the Rust regex crate's), so a letter added in a recent Unicode version can be a letter to
one and unassigned to the other, which changes the pre-tokenization. Documents holding a code
point that this Python's ``unicodedata`` does not assign (newer than its Unicode version, which
both libraries cover) therefore go to the reference encoder; everything else goes to tiktoken.

``MEGATRON_LITE_GPT2_BPE=python`` forces the reference encoder (benchmarks compare the two that way).
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections.abc import Callable

from megatron_lite.data.gpt2_bpe import BYTE_ENCODER, END_OF_TEXT, GPT2_PATTERN, GPT2BPE, symbols_to_bytes

BACKEND_ENV = "MEGATRON_LITE_GPT2_BPE"
# sha256 of GPT-2's merges, one "a b\n" line per merge in rank order (no "#version" header).
GPT2_MERGES_SHA256 = "ac33235097fe06d4a8fff0feac994644809e6eb6ab70669e1e9fd40ae032428e"


def merges_sha256(bpe: GPT2BPE) -> str:
    merges = sorted(bpe.ranks, key=bpe.ranks.get)
    return hashlib.sha256("".join(f"{a} {b}\n" for a, b in merges).encode("utf-8")).hexdigest()


def is_gpt2_vocabulary(bpe: GPT2BPE) -> bool:
    """GPT-2's own merges, byte symbols at ids 0..255 and each merge result at id 256 + its rank
    (so ids order tokens exactly as the merges do, which tiktoken's ranks rely on)."""
    if len(bpe.ranks) != 50000 or merges_sha256(bpe) != GPT2_MERGES_SHA256:
        return False
    enc = bpe.encoder
    if any(enc.get(symbol) != i for i, symbol in enumerate(BYTE_ENCODER.values())):
        return False
    return all(enc.get(a + b) == 256 + rank for (a, b), rank in bpe.ranks.items())


class UnassignedCharacters:
    """Whether a text holds a code point this Python's ``unicodedata`` leaves unassigned (Cn).

    ASCII text is answered at once; the Basic Multilingual Plane is one ``re`` class (compiled to a
    bitmap, so a C-speed scan); the rarer characters above it (emoji, historic scripts) are looked
    up one by one. Surrogates count as assigned: both encoders replace lone ones alike.
    """

    def __init__(self):
        ranges, start = [], None
        for cp in range(0x10001):
            unassigned = cp < 0x10000 and unicodedata.category(chr(cp)) == "Cn"
            if unassigned and start is None:
                start = cp
            elif not unassigned and start is not None:
                ranges.append(f"\\u{start:04x}-\\u{cp - 1:04x}")
                start = None
        self.bmp = re.compile("[" + "".join(ranges) + "]")
        self.astral = re.compile("[\\U00010000-\\U0010ffff]")

    def __call__(self, text: str) -> bool:
        if text.isascii():
            return False
        if self.bmp.search(text) is not None:
            return True
        return any(unicodedata.category(c) == "Cn" for c in self.astral.findall(text))


def tiktoken_encoder(bpe: GPT2BPE) -> Callable[[str], list[int]] | None:
    """``text -> ids`` through tiktoken, or None (not installed, switched off, or not GPT-2's vocabulary)."""
    if os.environ.get(BACKEND_ENV, "auto") == "python":
        return None
    try:
        import tiktoken
    except ImportError:
        return None
    if not is_gpt2_vocabulary(bpe):
        return None
    ranks = {symbols_to_bytes(symbol): i for symbol, i in bpe.encoder.items() if symbol != END_OF_TEXT}
    encoding = tiktoken.Encoding("megatron_lite_gpt2", pat_str=GPT2_PATTERN.pattern, mergeable_ranks=ranks,
                                 special_tokens={})
    fast, reference, newer = encoding.encode_ordinary, bpe.encode, UnassignedCharacters()

    def encode(text: str) -> list[int]:
        # "<|endoftext|>" in the text is ordinary text in both, as in GPT-2's encoder
        return reference(text) if newer(text) else fast(text)

    return encode
