"""GPT-2 BPE through tiktoken's compiled encoder, when tiktoken is installed (optional extra ``fast``).

The pure-Python encoder in :mod:`megatron_lite.data.gpt2_bpe` stays the reference and the fallback.
tiktoken is used only for GPT-2's own vocabulary (the 50,000 merges of GPT-2's merges.txt, checked by
hash, with token ids in merge order), because its algorithm is not GPT-2's in general: it joins the
adjacent pair whose *concatenation* has the lowest id, while GPT-2 joins the pair with the lowest
merge-rule rank. The two differ on a vocabulary where some token ``xy`` was created by another
split than ``(x, y)`` and that split can arise while encoding; on GPT-2's vocabulary OpenAI ships
tiktoken as GPT-2's encoder, and the tests compare both encoders on the sample corpus and on
adversarial text. Any other vocabulary (a locally trained one) keeps the reference encoder.

``MEGATRON_LITE_GPT2_BPE=python`` forces the reference encoder (benchmarks compare the two that way).
"""

from __future__ import annotations

import hashlib
import os
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
    return encoding.encode_ordinary  # "<|endoftext|>" in the text is ordinary text, as in the reference
