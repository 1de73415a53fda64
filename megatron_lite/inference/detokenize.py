"""Incremental detokenization: a sequence's generated text followed token by token, for the
streamed answer (:mod:`.api_stream`), for ending a sequence at a stop string while it decodes
(:mod:`.stop_strings`) and for the segments of ``PUT /api``'s answer (:func:`token_segments`). The window of :class:`TextStream` is described in :mod:`.api_stream`."""

from __future__ import annotations

from dataclasses import replace


def continuation_text(tokenizer, result) -> str:
    """The text the generated tokens add after the prompt's: decoded in context, so a tokenizer that
    puts spaces between tokens or marks word starts (SentencePiece) joins them as it would."""
    prompt = tokenizer.detokenize(result.tokens[:result.prompt_length])
    whole = tokenizer.detokenize(result.tokens)
    return whole[len(prompt):] if whole.startswith(prompt) else tokenizer.detokenize(result.generated)


def without_end(result, eod: int | None):
    """``result`` (a :class:`~megatron_lite.inference.engine.Generation`) less the end-of-document token
    that ended it: OpenAI's answers, as vLLM's and OpenAI's, show no text for the token that stops a
    sequence (GPT-2's ``<|endoftext|>``, a Hugging Face tokenizer's ``</s>`` or ``<|im_end|>``);
    its log-prob is still returned and counted in the usage, as vLLM does."""
    ends = (eod is not None and result.finish_reason == "stop" and len(result.tokens) > result.prompt_length
            and result.tokens[-1] == eod)
    return replace(result, tokens=result.tokens[:-1], log_probs=result.log_probs[:-1]) if ends else result


def answer_text(tokenizer, result) -> str:
    """The generated text of an OpenAI answer: :func:`continuation_text` without the end-of-document token's."""
    return continuation_text(tokenizer, without_end(result, getattr(tokenizer, "eod", None)))


def safe_end(text: str, stops: list[str]) -> int:
    """How much of ``text`` cannot change as more tokens come: up to a trailing U+FFFD (an
    incomplete UTF-8 character) and before a tail that is the start of a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return min(end, len(text) - hold)


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` before the first stop string in it, and whether there was one."""
    cuts = [text.find(s) for s in stops if s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


CONTEXT = 5
"""Tokens decoded before the new ones (:class:`TextStream`): a tokenizer whose text for a token
depends on the one before (SentencePiece's word starts, byte-level BPE's split characters) decodes
them as it does in the whole text."""


class TextStream:
    """One choice's text, sent piece by piece as its tokens come.

    Each token is decoded in a bounded window (vLLM's incremental detokenization): the text the
    tokens ``[start, len)`` decode to, less the text of ``[start, read)`` (``start``: up to
    :data:`CONTEXT` tokens already decoded, kept as context), is the new text, unless it ends in
    U+FFFD (the last token ends in the middle of a multi-byte character): then the window grows
    until the character is whole. A step costs two decodes of a few tokens, not of the whole text.
    """

    def __init__(self, tokenizer, prompt: list[int], stops: list[str], quiet_end: bool = False):
        """``quiet_end``: the end-of-document token, which ends the sequence, adds no text (OpenAI's
        answers: :func:`answer_text`)."""
        self.tokenizer, self.stops = tokenizer, stops
        self.quiet_end = getattr(tokenizer, "eod", None) if quiet_end else None
        self.tokens = list(prompt)
        self.start, self.read = max(len(prompt) - CONTEXT, 0), len(prompt)
        self.text = ""  # the generated text of tokens[:read]
        self.ends: list[int] = []
        """Per generated token: the length of the text decoded up to it, a character it holds only part
        of left out (as :func:`~.api_logprobs.covered` counts); what streamed log-probs read instead of
        decoding (:meth:`~.api_logprobs.ChunkLogprobs.upto`)."""
        self.sent = ""
        self.stopped = False  # a stop string ended the text

    def push(self, token: int) -> str:
        """The new text ``token`` lets us send (often ""); nothing once a stop string was met."""
        if self.stopped:
            return ""
        if token == self.quiet_end and self.quiet_end is not None:
            self.ends.append(len(self.text))
            return ""
        self.tokens.append(token)
        before = self.tokenizer.detokenize(self.tokens[self.start:self.read])
        after = self.tokenizer.detokenize(self.tokens[self.start:])
        whole = after.rstrip("\ufffd")  # the characters decoded whole
        self.ends.append(len(self.text) + max(len(whole) - len(before), 0) if after.startswith(before) else len(self.text))
        if len(after) <= len(before) or whole != after or not after.startswith(before):
            return ""  # nothing new yet (a character still incomplete); finish() sends what is left
        checked = len(self.text)
        self.text += after[len(before):]
        self.start, self.read = self.read, len(self.tokens)
        cut = self._stop(checked)
        self.stopped = cut is not None
        text = self.text if cut is None else self.text[:cut]
        return self._send(text, len(text) if self.stopped else safe_end(text, self.stops))

    def _stop(self, checked: int) -> int | None:
        """Where the first stop string in the text starts (None: none); the text's first ``checked``
        characters held none, so only the tail that can reach past them is searched."""
        if not self.stops:
            return None
        low = max(0, checked - max(len(s) for s in self.stops) + 1)
        found = [i for i in (self.text.find(s, low) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def finish(self, result) -> str:
        """The rest of the text, as the non-streamed answer has it (``result``: the engine's
        :class:`~megatron_lite.inference.engine.Generation`)."""
        whole = continuation_text(self.tokenizer, without_end(result, self.quiet_end))
        text, stopped = cut_at_stop(whole, self.stops)
        self.stopped = self.stopped or stopped
        return self._send(text, len(text))

    def _send(self, text: str, end: int) -> str:
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):end], text[:end]
        return piece


def _pieces(tokenizer, context: list[int], tokens: list[int], text: str) -> list[str]:
    """What each of ``tokens`` adds after ``context`` (a :class:`TextStream`); what the stream still
    holds at the end (a character the last token leaves incomplete) goes to the last piece, so the
    pieces join to ``text``, the tokens' text decoded whole."""
    stream = TextStream(tokenizer, context, [])
    pieces = [stream.push(t) for t in tokens]
    joined = "".join(pieces)
    if pieces and text.startswith(joined):
        pieces[-1] += text[len(joined):]
    return pieces


def token_segments(tokenizer, result) -> list[str]:
    """``PUT /api``'s ``segments``: per token of ``result`` (prompt and generated), the text it adds to
    the tokens before it, decoded in context: a token holding only the first bytes of a character
    adds "" and the one completing it the whole character (never U+FFFD), a SentencePiece word start
    its space. The prompt's segments join to its decoded text and the generated tokens' to
    :func:`continuation_text` (the answer's generated text)."""
    tokens, n = list(result.tokens), result.prompt_length
    head = _pieces(tokenizer, [], tokens[:n], tokenizer.detokenize(tokens[:n]))
    return head + _pieces(tokenizer, tokens[:n], tokens[n:], continuation_text(tokenizer, result))
