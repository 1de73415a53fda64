"""OpenAI's ``logprobs`` objects, for a whole answer and for the chunks of a streamed one.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` over the returned
tokens (with ``echo`` the prompt's first, whose first token has no log-prob: null), ``top_logprobs``
a dict per token keyed by text (two ids of one text: the more likely one's); chat:
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``,
every one of the best ids listed (``bytes``: the text's UTF-8, null for part of a character). A streamed choice hands out the same
entries chunk by chunk (:class:`ChunkLogprobs`): each chunk carries the tokens whose text it
completes, and the entries of all its chunks, joined, are the non-streamed answer's.
"""

from __future__ import annotations

from .detokenize import continuation_text
from .engine import Generation

TOKEN_CONTEXT = 4  # tokens decoded before a token to find its own text (vLLM's incremental detokenization)


def token_text(tokenizer, tokens: list[int], i: int, token: int | None = None) -> str:
    """The text token ``i`` of ``tokens`` (or ``token`` in its place) adds after the tokens before it,
    decoded with a few of them as context: a SentencePiece word start keeps its space (" list", not
    "list", which decoding the piece alone gives), so the tokens join to the text and ``text_offset``
    points into it. Alone where the context does not decode as a prefix (a character split over tokens)."""
    token = tokens[i] if token is None else token
    before = tokens[max(0, i - TOKEN_CONTEXT):i]
    head = tokenizer.detokenize(before) if before else ""
    whole = tokenizer.detokenize(before + [token])
    return whole[len(head):] if before and whole.startswith(head) else tokenizer.detokenize([token])


def logprobs_object(result: Generation, tokenizer, first: int, end: int, chat: bool, start_offset: int = 0) -> dict:
    """The logprobs object of ``result``'s tokens ``[first, end)``; ``start_offset``: the text offset of
    token ``first`` (completions' ``text_offset`` counts each token's own text from the choice's start)."""
    strings = [token_text(tokenizer, result.tokens, i) for i in range(first, end)]
    values = [None if i == 0 else result.log_probs[i - 1] for i in range(first, end)]
    tops = None  # per token: its position's best (text, log-prob) pairs, best first (several may share a text)
    if result.top_log_probs is not None:
        tops = [None if i == 0 else [(token_text(tokenizer, result.tokens, i, t), v) for t, v in result.top_log_probs[i - 1]]
                for i in range(first, end)]
    if chat:  # OpenAI's list of {token, logprob, bytes}: every entry, also two ids of one text
        return {"content": [{"token": s, "logprob": v, "bytes": _utf8(s), "top_logprobs": [
            {"token": k, "logprob": p, "bytes": _utf8(k)} for k, p in (tops[j] or [])] if tops else []}
            for j, (s, v) in enumerate(zip(strings, values))]}
    if tops is not None:  # OpenAI's dict keyed by text
        tops = [None if top is None else _by_text(top) for top in tops]
    offsets, pos = [], start_offset
    for s in strings:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": strings, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """Best-first (text, log-prob) pairs as a dict keyed by text: of two ids with one text, the more
    likely one's log-prob (not the later, less likely one's)."""
    out = {}
    for text, value in top:
        out.setdefault(text, value)
    return out


def _utf8(text: str) -> list[int] | None:
    """OpenAI's ``bytes`` of a token: its text's UTF-8; None for a part of a character (decoded as
    U+FFFD), whose own bytes the text does not hold."""
    return None if "\ufffd" in text else list(text.encode("utf-8"))


def covered(tokenizer, result: Generation, start: int, length: int) -> int:
    """The fewest tokens, at least ``start``, whose generated text (decoded in context) is at least
    ``length`` characters long: those holding the first ``length`` characters of the text (a
    character whose UTF-8 bytes span several tokens needs them all: its U+FFFD does not count)."""
    end = start
    while end < len(result.tokens) and len(continuation_text(tokenizer, prefix(result, end)).rstrip("\ufffd")) < length:
        end += 1
    return end


def prefix(result: Generation, end: int) -> Generation:
    """``result`` cut to its first ``end`` tokens (for decoding a part of the generated text)."""
    return Generation(result.tokens[:end], result.prompt_length, result.log_probs[:end - 1])


class ChunkLogprobs:
    """One streamed choice's logprobs objects, one per chunk (see the module docstring)."""

    def __init__(self, tokenizer, prompt: list[int], chat: bool, echo: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.result = Generation(list(prompt), len(prompt), [], top_log_probs=None)
        self.given = 0 if echo else len(prompt)  # tokens whose entries were handed out
        self.offset = 0

    def add(self, step, i: int, token: int | None) -> None:
        """Take the log-probs sequence ``i`` got in the engine's ``step`` (a :class:`~.engine.Step`),
        and its new ``token``."""
        if step.log_probs is None:
            raise RuntimeError("the engine was not asked for each step's log-probs (SamplingParams.step_log_probs)")
        self.result.log_probs += step.log_probs[i]
        if step.top_log_probs is not None:
            self.result.top_log_probs = (self.result.top_log_probs or []) + step.top_log_probs[i]
        if token is not None:
            self.result.tokens.append(token)

    def finish(self, result: Generation) -> None:
        """Use the engine's final ``result`` (the same values) for what is left."""
        self.result = result

    def prompt(self) -> dict:
        """The prompt's entries (``echo``)."""
        return self.take(self.result.prompt_length)

    def upto(self, length: int, ends: list[int] | None = None) -> dict:
        """The entries of the generated tokens holding the first ``length`` characters of the text;
        ``ends``: per generated token, the text's length once it is decoded (:class:`~.api_stream.TextStream`'s),
        read from the last token handed out on (no decoding); without it, or beyond it, the
        prefixes are decoded (:func:`covered`)."""
        first = self.result.prompt_length
        start = max(self.given, first)
        for j in range(max(start - first - 1, 0), len(ends or ())):
            if ends[j] >= length:
                return self.take(max(first + j + 1, start) if length > 0 else start)
        return self.take(covered(self.tokenizer, self.result, start, length))

    def rest(self) -> dict:
        return self.take(len(self.result.tokens))

    def take(self, end: int) -> dict:
        """The entries of the tokens from the last one handed out to ``end`` (exclusive)."""
        end = max(end, self.given)
        out = logprobs_object(self.result, self.tokenizer, self.given, end, self.chat, self.offset)
        self.offset += sum(len(token_text(self.tokenizer, self.result.tokens, i)) for i in range(self.given, end))
        self.given = end
        return out
