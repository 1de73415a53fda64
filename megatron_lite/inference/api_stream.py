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
sending them (a request of the continuous batch is cancelled instead, and a speculative one stops
at its next verify step: :func:`drain`). An error raised by the engine mid-stream (the HTTP status, 200, is already sent) is
sent as one ``data: {"error": {...}}`` event (OpenAI's error shape, ``"type": "server_error"``,
``"code": 500``: :func:`~.http_errors.error_body`), after which the stream ends.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from .api_logprobs import ChunkLogprobs
from .detokenize import CONTEXT, TextStream, cut_at_stop, safe_end  # noqa: F401 - also imported from here
from .http_errors import error_body

log = logging.getLogger(__name__)


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def drain(steps) -> None:
    """Run the engine's remaining steps (every rank takes part in each), sending nothing; ``steps``
    with a ``cancel`` are cancelled first: a request of the continuous batch
    (:class:`~.batch_runner.Steps`) leaves the batch at the next step, a speculative one stops at
    its next verify step."""
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

    streams = [TextStream(tokenizer, p, job.stops, quiet_end=True) for p in job.prompts]
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
        yield sse(error_body("/v1/", f"{type(err).__name__}: {err}", 500))
    finally:
        drain(steps)
