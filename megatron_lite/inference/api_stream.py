"""``"stream": true`` for the OpenAI-compatible routes: server-sent events in OpenAI's format.

Each event is ``data: <json chunk>\\n\\n``; a chunk carries the text one decode step added to one
choice (completions: ``choices[].text``; chat: ``choices[].delta``, whose first chunk per choice is
``{"role": "assistant", "content": ""}``), a choice's last chunk carries its ``finish_reason``, and
the stream ends with ``data: [DONE]``. With ``stream_options.include_usage`` every chunk has
``"usage": null`` and one more chunk, with no choices, carries the request's usage (as the
non-streamed answer counts it).

The text sent is exactly the non-streamed answer's, cut into pieces: after each step the choice's
new token is decoded in a window of the few tokens before it (:class:`TextStream`: the cost of a
step does not grow with the text) and the new text is sent, except what could still change: a
character whose UTF-8 bytes are not all decoded yet (the window then ends in U+FFFD and waits for
the next token) and a tail that could be the start of a stop string. The last chunk of a choice
comes from the whole text, decoded once (:func:`~.api_megatron.continuation_text`).
A stop string ends the choice's text before it, and none of it is ever sent.

With ``logprobs`` each chunk's ``choices[].logprobs`` holds the entries of the tokens whose text it
completes (:class:`~.api_logprobs.ChunkLogprobs`, which reads where each token's text ends from
:attr:`TextStream.ends` instead of decoding again), from the log-probs the engine broadcasts after
every step (``SamplingParams.step_log_probs``); with ``echo`` the prompt's chunk, and its entries,
come with the choice's first generated token (or at the end when nothing is generated).

Every rank runs every decode step (the engine's steps are collectives), so the events generator
runs the engine to its end whatever happens to the client: when the client disconnects, the
server's write fails, the generator is closed, and its ``finally`` runs the remaining steps without
sending them (a request of the continuous batch is cancelled instead: :func:`drain`). An error raised by the engine mid-stream (the HTTP status, 200, is already sent) is
sent as one ``data: {"error": {...}}`` event, after which the stream ends.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from .api_logprobs import ChunkLogprobs
from .api_megatron import continuation_text
from .engine import Generation

log = logging.getLogger(__name__)


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

    def __init__(self, tokenizer, prompt: list[int], stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
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

    def finish(self, result: Generation) -> str:
        """The rest of the text, as the non-streamed answer has it (``result``: the engine's)."""
        text, stopped = cut_at_stop(continuation_text(self.tokenizer, result), self.stops)
        self.stopped = self.stopped or stopped
        return self._send(text, len(text))

    def _send(self, text: str, end: int) -> str:
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):end], text[:end]
        return piece


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def drain(steps) -> None:
    """Run the engine's remaining steps (every rank takes part in each), sending nothing; a request
    of the continuous batch (:class:`~.batch_runner.Steps`) is cancelled instead: it leaves the
    batch at the next step."""
    if hasattr(steps, "cancel"):
        steps.cancel()
    try:
        for _ in steps:
            pass
    except Exception:  # noqa: BLE001 - the client is gone; the error was the engine's, on every rank
        log.exception("request failed after its client left")


def stream_events(job, steps, tokenizer, model_name: str, usage):
    """The server-sent events of ``job`` as the engine's ``steps`` run; ``usage(results)``: the
    non-streamed answer's usage object."""
    chat = job.chat
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model_name}
    extra = {"usage": None} if job.include_usage else {}

    def chunk(index: int, text: str | None, reason: str | None = None, role: bool = False, logprobs=None) -> str:
        choice = {"index": index}
        if chat:
            choice["delta"] = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": logprobs, "finish_reason": reason}
        return sse(head | {"choices": [choice]} | extra)

    streams = [TextStream(tokenizer, p, job.stops) for p in job.prompts]
    scores = [ChunkLogprobs(tokenizer, p, chat, job.echo) for p in job.prompts] if job.logprobs is not None else None
    ended = [False] * len(streams)
    echo = [job.echo and not chat] * len(streams)  # the prompt's chunk is still to come (completions' echo)

    def prompt_chunk(i: int) -> str:  # with log-probs it waits for them: until the choice's first token
        echo[i] = False
        return chunk(i, job.texts[i // job.n], logprobs=scores[i].prompt() if scores else None)

    try:
        for i in range(len(streams)):
            if chat:
                yield chunk(i, "", role=True)
            elif echo[i] and not scores:
                yield prompt_chunk(i)
        while True:
            try:
                new = next(steps)
            except StopIteration as end:
                results = end.value
                break
            for i, token in enumerate(new):
                if scores:
                    scores[i].add(new, i, None if ended[i] else token)
                if token is None or ended[i]:
                    continue
                if echo[i]:
                    yield prompt_chunk(i)
                piece = streams[i].push(token)
                ended[i] = streams[i].stopped
                if piece or ended[i]:
                    logprobs = scores[i].upto(len(streams[i].sent), streams[i].ends) if scores else None
                    yield chunk(i, piece, "stop" if ended[i] else None, logprobs=logprobs)
        for i, result in enumerate(results):
            if scores:
                scores[i].finish(result)
            if echo[i]:
                yield prompt_chunk(i)
            if not ended[i]:
                piece = streams[i].finish(result)
                reason = "stop" if streams[i].stopped or result.finish_reason == "stop" else "length"
                logprobs = None
                if scores:
                    logprobs = scores[i].upto(len(streams[i].sent), streams[i].ends) if streams[i].stopped else scores[i].rest()
                yield chunk(i, piece, reason, logprobs=logprobs)
        if job.include_usage:
            yield sse(head | {"choices": [], "usage": usage(results)})
        yield sse("[DONE]")
    except Exception as err:  # noqa: BLE001 - the status (200) is sent: the error goes in the stream
        log.exception("request failed mid-stream")
        yield sse({"error": {"message": f"{type(err).__name__}: {err}", "type": type(err).__name__}})
    finally:
        drain(steps)
