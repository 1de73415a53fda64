"""Megatron's ``PUT /api``: the request fields, their checks, and the response.

Request (JSON object; defaults as in Megatron-LM):

=====================  =========  ============================================================
field                  default    meaning
=====================  =========  ============================================================
prompts                required   list of 1-128 strings
tokens_to_generate     64         new tokens per prompt (0: only score the prompts; needs logprobs)
logprobs               false      return the log-prob of every token after the first
temperature            1.0        in (0, 100]
top_k                  0          1 is greedy; 0 no top-k filtering
top_p                  0.0        in [0, 1]; not together with top_k
add_BOS                false      prepend the tokenizer's BOS token, or its end-of-document token when it
                                  has none, e.g. GPT-2 (needed by an empty prompt)
stop_on_eol            false      also stop a sequence at a token containing a newline
random_seed            -1         >= 0 reseeds the sampling generator for reproducible samples
no_log                 false      accepted (requests are not logged)
stop_token             EOD        the token id that ends a sequence instead of the end-of-document token
stop_on_double_eol     false      stop at a newline token right after another one, or at a token
                                  holding two newlines (then ``stop_on_eol`` alone does not stop)
prevent_newline_after_colon (false): after a token ending in ":" no token holding a newline is chosen
top_p_decay            0.0        in [0, 1]: top_p is multiplied by it after every step (needs top_p)
top_p_bound            0.0        in (0, top_p]: the decayed top_p never goes below it (needs top_p)
beam_width             none       1-128: beam search over one prompt (:mod:`.beam`)
length_penalty         1.0        beam search: score = sum of log-probs / length ** length_penalty
=====================  =========  ============================================================

Response: ``text`` (each prompt followed by its generated text), ``segments`` (the text each token adds to
the ones before it: :func:`~.detokenize.token_segments`),
``tokens`` (prompt and generated ids) and, with ``logprobs``, ``logprobs`` (``len(tokens) - 1``
values per prompt). With ``beam_width``: ``text``, ``segments`` and ``scores`` of the
``beam_width`` best hypotheses, best first (Megatron's beam answer). A bad request gets HTTP 400
with ``{"message": "..."}``: one line naming the field. Beam search is deterministic, so a
sampling field set to other than its default (``temperature``, ``top_k``, ``top_p``, ``top_p_decay``,
``top_p_bound``, ``random_seed``, ``logprobs``, ``stop_on_eol``, ``stop_on_double_eol``) is refused
with ``beam_width``, and ``length_penalty`` other than 1 without it (Megatron ignores them).

``add_BOS``: Megatron-LM's inference engine (``megatron.core``) prepends the tokenizer's BOS; its
older text-generation code prepended the end-of-document token, which is also what a GPT-2
tokenizer (no BOS) gets here: the token that starts a document in data preprocessed with
``--append-eod``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .detokenize import continuation_text, token_segments
from .fields import RequestError, check_fields, get_bool, get_int, get_number, tokenize_field
from .sampling import MAX_SEED, SamplingParams

MAX_PROMPTS = 128
MAX_BEAMS = 128
KNOWN = {"prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "add_BOS", "stop_on_eol",
         "random_seed", "no_log", "stop_token", "stop_on_double_eol", "prevent_newline_after_colon", "top_p_decay",
         "top_p_bound", "beam_width", "length_penalty"}
UNSUPPORTED = {
    "max_len": "max_len is no longer used; replace it with tokens_to_generate",
    "sentences": "sentences is no longer used; replace it with prompts",
}
SAMPLING_ONLY = {"temperature": 1.0, "top_k": 0, "top_p": 0.0, "top_p_decay": 0.0, "top_p_bound": 0.0,
                 "random_seed": -1, "logprobs": False, "stop_on_eol": False, "stop_on_double_eol": False}


@dataclass
class ApiJob:
    texts: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    logprobs: bool
    beam: bool = False


_SPECIAL: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}


def special_token_ids(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Ids of the tokens whose text holds a newline, holds two, and ends with ":" (what
    ``stop_on_eol``, ``stop_on_double_eol`` and ``prevent_newline_after_colon`` look at); computed once."""
    key = id(tokenizer)
    if key not in _SPECIAL:
        found = ([], [], [])
        for i in range(tokenizer.vocab_size):
            try:
                text = tokenizer.detokenize([i])
            except (KeyError, IndexError, ValueError):
                continue
            for ids, hit in zip(found, ("\n" in text, "\n\n" in text, text.endswith(":"))):
                if hit:
                    ids.append(i)
        _SPECIAL[key] = tuple(tuple(ids) for ids in found)
    return _SPECIAL[key]


def newline_token_ids(tokenizer) -> tuple[int, ...]:
    """Ids of the tokens whose text holds a newline (what ``stop_on_eol`` stops at)."""
    return special_token_ids(tokenizer)[0]


def _prompts(body) -> list[str]:
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts must be a list of strings")
    if not prompts:
        raise RequestError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    return prompts


def parse_api(body, tokenizer) -> ApiJob:
    """The job a ``PUT /api`` body asks for; RequestError with one line when it is bad."""
    check_fields(body, KNOWN, UNSUPPORTED)
    texts = _prompts(body)
    n = get_int(body, "tokens_to_generate", 64, low=0)
    logprobs = get_bool(body, "logprobs", False)
    if n == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 only scores the prompts: it needs logprobs=true")
    temperature = get_number(body, "temperature", 1.0, low=0.0, high=100.0, low_open=True)
    top_k = get_int(body, "top_k", 0, low=0, high=1000)
    top_p = get_number(body, "top_p", 0.0, low=0.0, high=1.0)
    if top_k > 0 and top_p > 0:
        raise RequestError("cannot set both top_k and top_p; use one of them")
    add_bos = get_bool(body, "add_BOS", False)
    stop_on_eol = get_bool(body, "stop_on_eol", False)
    seed = get_int(body, "random_seed", -1, low=-1, high=MAX_SEED - 1)
    get_bool(body, "no_log", False)
    if any(not t for t in texts) and not add_bos:
        raise RequestError("an empty prompt needs add_BOS=true")
    bos = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
    if add_bos and bos is None:
        raise RequestError("add_BOS: the tokenizer has no beginning- or end-of-document token")
    prompts = [([bos] if add_bos else []) + (tokenize_field(tokenizer, t, f"prompts[{i}]") if t else [])
               for i, t in enumerate(texts)]
    params = SamplingParams(tokens_to_generate=n, temperature=temperature, top_k=top_k, top_p=top_p,
                            random_seed=None if seed < 0 else seed, prompt_log_probs=logprobs, **_stops(body, tokenizer, stop_on_eol),
                            **_top_p_schedule(body, top_p), **_beam(body, len(texts), n, tokenizer))
    return ApiJob(texts, prompts, params, logprobs, beam=params.beam_width > 0)


def _stops(body, tokenizer, stop_on_eol: bool) -> dict:
    """The SamplingParams fields of stop_token, stop_on_eol, stop_on_double_eol and
    prevent_newline_after_colon."""
    stop_token = get_int(body, "stop_token", None, low=0, high=tokenizer.vocab_size - 1)
    double = get_bool(body, "stop_on_double_eol", False)
    no_newline = get_bool(body, "prevent_newline_after_colon", False)
    newline, two_newlines, colon = special_token_ids(tokenizer) if stop_on_eol or double or no_newline else ((),) * 3
    stops = two_newlines if double else newline if stop_on_eol else ()
    return dict(stop_on_eod=stop_token is None, stop_token_ids=tuple(stops) + ((stop_token,) if stop_token is not None else ()),
                double_stop_ids=newline if double else (), ban_after_ids=colon if no_newline else (),
                banned_ids=newline if no_newline else ())


def _top_p_schedule(body, top_p: float) -> dict:
    """Megatron's top_p_decay and top_p_bound (each needs top_p)."""
    for name in ("top_p_decay", "top_p_bound"):
        if name in body and top_p == 0.0:
            raise RequestError(f"{name} needs top_p > 0; set top_p or drop {name}")
    decay = get_number(body, "top_p_decay", 0.0, low=0.0, high=1.0)
    bound = get_number(body, "top_p_bound", 0.0, low=0.0, high=top_p, low_open="top_p_bound" in body)
    return dict(top_p_decay=decay, top_p_bound=bound)


def _beam(body, prompts: int, n: int, tokenizer) -> dict:
    """beam_width and length_penalty; the fields beam search cannot honour are refused."""
    penalty = get_number(body, "length_penalty", 1.0)
    if not math.isfinite(penalty):
        raise RequestError(f"length_penalty must be a finite number, got {penalty!r}")
    if "beam_width" not in body:
        if penalty != 1.0:
            raise RequestError("length_penalty applies to beam search only; set beam_width or drop length_penalty")
        return {}
    # default 0 (never used: the field is there): a null beam_width is refused as not an integer
    width = get_int(body, "beam_width", 0, low=1, high=min(MAX_BEAMS, tokenizer.vocab_size - 1))
    if prompts != 1:
        raise RequestError(f"beam_width: beam search takes exactly one prompt, got {prompts}")
    if n < 1:
        raise RequestError("beam_width: beam search needs tokens_to_generate >= 1")
    for name, default in SAMPLING_ONLY.items():
        if name in body and body[name] != default:
            raise RequestError(f"{name} does not apply to beam search (beam_width); drop it")
    return dict(beam_width=width, length_penalty=penalty)


def api_response(job: ApiJob, results, tokenizer) -> dict:
    """Megatron's response: text, segments, tokens (and logprobs when asked); for beam search
    text, segments and scores of every hypothesis."""
    if job.beam:
        return {"text": [job.texts[0] + continuation_text(tokenizer, r) for r in results],
                "segments": [token_segments(tokenizer, r) for r in results],
                "scores": [r.score for r in results]}
    out = {
        "text": [text + continuation_text(tokenizer, r) for text, r in zip(job.texts, results)],
        "segments": [token_segments(tokenizer, r) for r in results],
        "tokens": [r.tokens for r in results],
    }
    if job.logprobs:
        out["logprobs"] = [r.log_probs for r in results]
    return out
