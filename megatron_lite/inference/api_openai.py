"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions``.

Completions fields: ``prompt`` (a string, a list of strings, a list of token ids or a list of such
lists; required), ``max_tokens`` (16), ``temperature`` (1.0; 0 is greedy), ``top_p`` (1.0: no
filtering; 0 is greedy), ``top_k`` (0; an extension), ``logprobs`` (null, or n in [0, 20]: the chosen token's
log-prob and the n best at every position), ``echo`` (false: include the prompt in the text and
log-probs), ``stop`` (a string or a list of up to 4: the text ends before the first one), ``seed``,
``stream`` (false; server-sent events, see :mod:`.api_stream`) with ``stream_options``, and
``n`` (1: completions per prompt, sampled independently in one batch; greedy gives n equal
ones), ``best_of`` (n: samples per prompt, at least n, of which the n with the highest cumulative
log-prob are returned; not with ``stream``), ``model`` (the served ``--model-name``; another is
HTTP 404: :func:`check_model`) and ``user`` accepted; a field set to
``null`` takes its default, as in OpenAI's API. vLLM's ``use_beam_search`` (with ``length_penalty``)
runs beam search instead of sampling, on either route (:mod:`.api_beam`). Chat completions
take ``messages`` (through the chat template, see :mod:`.chat`) instead of ``prompt``, and
``logprobs`` (bool) with ``top_logprobs``; ``max_completion_tokens`` is ``max_tokens``' newer name
(absent: 256, or what the model's context leaves after the prompt when that is less).
``presence_penalty`` and ``frequency_penalty`` (0, in [-2, 2]) and ``logit_bias`` (token id ->
bias in [-100, 100]) adjust the logits as OpenAI defines them (see :func:`.sampling.adjust_logits`).
A field that would change the result but is not implemented (``suffix``, ``tools``,
``response_format``) is refused with HTTP 400, never ignored; the log-prob objects are built in
:mod:`.api_logprobs`, also chunk by chunk for ``logprobs`` with ``stream``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .api_beam import BEAM_FIELDS, beam_job, beam_params, best_beams
from .api_logprobs import covered, logprobs_object, prefix
from .api_stream import cut_at_stop
from .chat import chat_prompt
from .detokenize import answer_text
from .fields import RequestError, UnknownModel, check_fields, get_bool, get_int, get_number, tokenize_field
from .sampling import MAX_SEED, SamplingParams

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "best_of", "stream", "user",
          "presence_penalty", "frequency_penalty", "logit_bias"}
COMMON |= {"stream_options"} | BEAM_FIELDS
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
MAX_BATCH = 128  # prompts x n per request
DEFAULT_CHAT_TOKENS = 256  # chat's max_tokens when absent (and the context has room)
UNSUPPORTED = {"suffix": "suffix (insertion) is not supported; drop it",
               "tools": "tools (function calling) are not supported; drop them",
               "response_format": "response_format is not supported; drop it"}


@dataclass
class OpenAIJob:
    texts: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    echo: bool = False
    logprobs: int | None = None
    stops: list[str] = field(default_factory=list)
    chat: bool = False
    stream: bool = False
    include_usage: bool = False
    """stream_options.include_usage: the stream's last chunk carries the usage."""
    n: int = 1
    """Completions per prompt returned."""
    best_of: int = 1
    """Completions per prompt generated (at least ``n``; ``prompts`` holds each prompt this many times
    in a row): the ``n`` with the highest cumulative log-prob are returned. With ``beam``: the beam width."""
    beam: bool = False
    """use_beam_search: each prompt (once in ``prompts``) gets ``best_of`` beams, the ``n`` best returned
    (:mod:`.api_beam`)."""


def _logit_bias(body, vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: a JSON object from token ids (as strings, JSON's keys) to biases in [-100, 100]."""
    bias = body.get("logit_bias", {})
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must be an object mapping token ids to biases in [-100, 100]")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab:
            raise RequestError(f"logit_bias: {key!r} is not a token id in [0, {vocab})")
        name = f"logit_bias[{key}]"
        pairs.append((int(key), get_number({name: value}, name, 0.0, low=-100.0, high=100.0)))
    return tuple(sorted(pairs))


def _sampling(body, max_tokens: int, top_n: int, vocab: int) -> SamplingParams:
    penalties = {name: get_number(body, name, 0.0, low=-2.0, high=2.0)
                 for name in ("presence_penalty", "frequency_penalty")}
    temperature = get_number(body, "temperature", 1.0, low=0.0, high=100.0)
    top_p = get_number(body, "top_p", 1.0, low=0.0, high=1.0)
    top_k = get_int(body, "top_k", 0, low=-1, high=1000)
    top_k = max(top_k, 0)
    if top_k > 0 and top_p < 1.0:
        raise RequestError("cannot set both top_k and top_p (< 1); use one of them")
    seed = get_int(body, "seed", None, low=0, high=MAX_SEED - 1)
    greedy = temperature == 0.0 or top_p == 0.0  # a nucleus of mass 0 holds the most likely token only
    return SamplingParams(tokens_to_generate=max_tokens, temperature=temperature if not greedy else 1.0,
                          top_k=1 if greedy else top_k, top_p=0.0 if greedy or top_p >= 1.0 else top_p,
                          random_seed=seed, top_n_logprobs=top_n, logit_bias=_logit_bias(body, vocab),
                          stop_strings=tuple(_stops(body)), **penalties)  # the engine ends a sequence there


def _copies(body, job: OpenAIJob, vocab: int) -> OpenAIJob:
    """``job`` asking for ``n`` completions of each prompt, the best of ``best_of`` (default n): each
    prompt ``best_of`` times in a row in one batch (choice ``i * n + j`` is prompt i's j-th, as OpenAI
    numbers them)."""
    job.n = get_int(body, "n", 1, low=1, high=MAX_BATCH)
    job.best_of = get_int(body, "best_of", job.n, low=1, high=MAX_BATCH)
    if job.best_of < job.n:
        raise RequestError(f"best_of must be at least n ({job.n}), got {job.best_of}")
    if len(job.prompts) * job.best_of > MAX_BATCH:
        what = "n" if job.best_of == job.n else "best_of"
        raise RequestError(f"{what} x prompts is {len(job.prompts) * job.best_of}; "
                           f"at most {MAX_BATCH} completions per request")
    if job.beam:
        beam_params(job, vocab)
    else:
        job.prompts = [p for p in job.prompts for _ in range(job.best_of)]
    return job


def _streaming(body, job: OpenAIJob) -> OpenAIJob:
    """``job`` with ``stream`` and ``stream_options`` read (see :mod:`.api_stream`)."""
    job.stream = get_bool(body, "stream", False)
    options = body.get("stream_options", {})
    if "stream_options" in body and not job.stream:
        raise RequestError("stream_options needs stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("stream_options must be an object with only include_usage (a boolean)")
    job.include_usage = get_bool(options, "include_usage", False)
    if job.stream and job.beam:
        raise RequestError("use_beam_search cannot be streamed (the beams are known only at the end); drop stream")
    if job.stream and job.best_of > job.n:
        raise RequestError("best_of > n cannot be streamed (the best are known only at the end); drop stream or best_of")
    if job.stream and job.logprobs is not None:
        job.params.step_log_probs = True  # the engine hands out each step's log-probs with its tokens
    return job


def _stops(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError("stop must be a non-empty string or a list of up to 4 of them")
    return stops


def _prompt(body, tokenizer) -> tuple[list[str], list[list[int]], list[str]]:
    """The prompts' texts, token ids and names in the request (``prompt``, or ``prompt[i]`` in a list)."""
    if "prompt" not in body:
        raise RequestError("prompt is required")
    prompt = body["prompt"]
    is_ids = lambda x: isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)  # noqa: E731
    if isinstance(prompt, str):
        items = [prompt]
    elif is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        items = prompt
    else:
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of those")
    if len(items) > MAX_BATCH:
        raise RequestError(f"at most {MAX_BATCH} prompts per request, got {len(items)}")
    names = ["prompt"] if items is not prompt else [f"prompt[{i}]" for i in range(len(items))]
    ids = [tokenize_field(tokenizer, p, name) if isinstance(p, str) else list(p) for p, name in zip(items, names)]
    if any(not i for i in ids):
        raise RequestError("a prompt is empty (it needs at least one token)")
    if any(t < 0 or t >= tokenizer.vocab_size for i in ids for t in i):
        raise RequestError(f"a prompt token id is outside the vocabulary [0, {tokenizer.vocab_size})")
    return [p if isinstance(p, str) else tokenizer.detokenize(p) for p in items], ids, names


def _check_context(names: list[str], prompts: list[list[int]], max_tokens: int, limit: str,
                   max_length: int | None) -> None:
    """A RequestError naming the request's own field (``prompt``, ``prompt[i]``, ``messages``) where
    its tokens and ``max_tokens`` (named ``limit``) overrun the model's context: the engine checks
    again, but over the prompts as copied for ``n`` / ``best_of``, whose numbers are not the request's."""
    for name, ids in zip(names, prompts) if max_length is not None else ():
        if len(ids) + max_tokens > max_length:
            has = "have" if name == "messages" else "has"
            how = " (through the chat template)" if name == "messages" else ""
            asked = f" + {limit} {max_tokens}" if max_tokens else ""
            raise RequestError(f"{name} {has} {len(ids)} tokens{how}{asked}, more than the model's context of "
                               f"{max_length} tokens; shorten it{f' or lower {limit}' if max_tokens else ''}")


def _fields(body, known: set[str]) -> dict:
    """``body`` checked, without its null fields: OpenAI's optional fields are nullable, and
    ``"max_tokens": null`` (what clients send for "not set") means the default, as if left out;
    a field unknown here is refused even when null."""
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if v is not None or (k not in known and k not in UNSUPPORTED)}
    check_fields(body, known, UNSUPPORTED)
    for name in ("model", "user"):  # accepted (model: see check_model): still strings, as OpenAI's and vLLM's schemas say
        if name in body and not isinstance(body[name], str):
            raise RequestError(f"{name} must be a string, got {body[name]!r}")
    return body


def check_model(body, served: str) -> None:
    """UnknownModel (HTTP 404, vLLM's answer) where ``body`` names a ``model`` other than ``served``
    (``--model-name``); a request without one (absent, null or "") is for the served model."""
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and model and model != served:
        raise UnknownModel(f"The model `{model}` does not exist; this server serves `{served}` (--model-name)")


def parse_completion(body, tokenizer, max_length: int | None = None) -> OpenAIJob:
    """``max_length``: the model's context (None: not checked here)."""
    body = _fields(body, COMPLETION_FIELDS)
    texts, prompts, names = _prompt(body, tokenizer)
    max_tokens = get_int(body, "max_tokens", 16, low=0)
    _check_context(names, prompts, max_tokens, "max_tokens", max_length)
    logprobs = get_int(body, "logprobs", None, low=0, high=20)
    echo = get_bool(body, "echo", False)
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens=0 generates nothing: set echo=true to score the prompt")
    params = _sampling(body, max_tokens, logprobs or 0, tokenizer.vocab_size)
    params.prompt_log_probs = echo and logprobs is not None  # else a cached prompt prefix is not recomputed
    job = OpenAIJob(texts, prompts, params, echo, logprobs, _stops(body))
    return _streaming(body, _copies(body, beam_job(body, job), tokenizer.vocab_size))


def parse_chat(body, tokenizer, template: str | None = None, max_length: int | None = None) -> OpenAIJob:
    """``template``: the server's ``--chat-template`` (None: the tokenizer's, see inference/chat.py);
    ``max_length``: the model's context, which caps the default number of new tokens (as OpenAI's
    absent ``max_tokens``: as many as the context leaves, here at most 256)."""
    body = _fields(body, CHAT_FIELDS)
    prompt = chat_prompt(tokenizer, body.get("messages"), template)
    text = tokenizer.detokenize(prompt)
    limit = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if "max_tokens" in body and limit != "max_tokens" and body["max_tokens"] != body[limit]:
        raise RequestError(f"max_tokens {body['max_tokens']!r} and max_completion_tokens {body[limit]!r} differ; "
                           "send one of them (max_completion_tokens is max_tokens' newer name)")
    room = max_length - len(prompt) if max_length is not None else DEFAULT_CHAT_TOKENS
    max_tokens = get_int(body, limit, min(DEFAULT_CHAT_TOKENS, max(room, 1)), low=1)
    _check_context(["messages"], [prompt], max_tokens, limit, max_length)
    top = get_int(body, "top_logprobs", 0, low=0, high=20)
    logprobs = get_bool(body, "logprobs", False)
    if top and not logprobs:
        raise RequestError("top_logprobs needs logprobs=true")
    params = _sampling(body, max_tokens, top, tokenizer.vocab_size)
    params.prompt_log_probs = False  # the answer never shows them: a cached prompt prefix is not recomputed
    job = OpenAIJob([text], [prompt], params, False, top if logprobs else None, _stops(body))
    job.chat = True
    return _streaming(body, _copies(body, beam_job(body, job), tokenizer.vocab_size))


def _stop_text(tokenizer, result, stops: list[str]) -> tuple[str, bool]:
    """The generated text and whether a stop string ended it, as generation meets the stop strings
    (and the stream cuts them): the first generated token whose text completes one ends the text
    before it (the earliest of those it completes; a trailing character still incomplete, U+FFFD until
    its last byte comes, is not yet text). The engine may have generated on past that point
    (without a tokenizer: :mod:`.stop_strings`), and a longer stop string that began earlier may
    complete in that later text; it does not count."""
    text, stopped = cut_at_stop(answer_text(tokenizer, result), stops)
    for end in range(result.prompt_length + 1, len(result.tokens)) if stopped else ():
        # a prefix's trailing U+FFFD may be a character whose last bytes are still to come: left out,
        # as the stream and the engine wait for it (a stop string holding U+FFFD must not meet it)
        part, found = cut_at_stop(answer_text(tokenizer, prefix(result, end)).rstrip("\ufffd"), stops)
        if found:
            return part, True
    return text, stopped


def _choice(job: OpenAIJob, index: int, result, tokenizer) -> tuple[dict, int, float]:
    """The choice, how many generated tokens it returns (those before a stop string), and their
    cumulative log-prob (what ``best_of`` ranks by)."""
    text, stopped = _stop_text(tokenizer, result, job.stops)
    # keep the log-probs of the generated tokens whose text lies before the cut
    end = covered(tokenizer, result, result.prompt_length, len(text)) if stopped else len(result.tokens)
    reason = "stop" if stopped or result.finish_reason == "stop" else "length"
    prefix = job.texts[index // job.best_of] if job.echo else ""
    choice = {"index": index, "finish_reason": reason}
    if job.logprobs is not None:
        first = 0 if job.echo else result.prompt_length
        choice["logprobs"] = logprobs_object(result, tokenizer, first, end, job.chat)
    else:
        choice["logprobs"] = None
    if job.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = prefix + text
    return choice, end - result.prompt_length, sum(result.log_probs[result.prompt_length - 1:end - 1])


def _best(job: OpenAIJob, candidates: list[tuple[dict, int, float]]) -> list[tuple[dict, int, float]]:
    """Of each prompt's ``best_of`` candidates, the ``n`` with the highest cumulative log-prob, best
    first (the first generated wins a tie), numbered ``i * n + j``."""
    kept = []
    for start in range(0, len(candidates), job.best_of):
        group = candidates[start:start + job.best_of]
        kept += sorted(group, key=lambda c: -c[2])[:job.n]  # sorted() is stable: ties keep their order
    for index, (choice, _, _) in enumerate(kept):
        choice["index"] = index
    return kept


def openai_response(job: OpenAIJob, results, tokenizer, model_name: str) -> dict:
    """The answer; ``usage.completion_tokens`` counts the tokens returned (none after a stop string;
    with ``best_of`` only those of the n choices returned, as vLLM counts)."""
    prompt_tokens = sum(r.prompt_length for r in results[::job.best_of])  # each prompt once, as OpenAI counts
    candidates = [_choice(job, i, r, tokenizer) for i, r in enumerate(results)]
    if job.beam:
        candidates = best_beams(job, candidates)
    elif job.best_of > job.n:
        candidates = _best(job, candidates)
    choices, counts, _ = zip(*candidates)
    completion_tokens = sum(counts)
    return {
        "id": f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion" if job.chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": list(choices),
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
