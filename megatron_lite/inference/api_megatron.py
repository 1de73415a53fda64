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
=====================  =========  ============================================================

Response: ``text`` (each prompt followed by its generated text), ``segments`` (each token's text),
``tokens`` (prompt and generated ids) and, with ``logprobs``, ``logprobs`` (``len(tokens) - 1``
values per prompt). A bad request gets HTTP 400 with ``{"message": "..."}``: one line naming the field.

``add_BOS``: Megatron-LM's inference engine (``megatron.core``) prepends the tokenizer's BOS; its
older text-generation code prepended the end-of-document token, which is also what a GPT-2
tokenizer (no BOS) gets here: the token that starts a document in data preprocessed with
``--append-eod``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fields import RequestError, check_fields, get_bool, get_int, get_number
from .sampling import SamplingParams

MAX_PROMPTS = 128
KNOWN = {"prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "add_BOS", "stop_on_eol",
         "random_seed", "no_log"}
UNSUPPORTED = {
    "max_len": "max_len is no longer used; replace it with tokens_to_generate",
    "sentences": "sentences is no longer used; replace it with prompts",
    "beam_width": "beam search is not supported; drop beam_width",
    "length_penalty": "length_penalty belongs to beam search, which is not supported; drop it",
    "stop_on_double_eol": "stop_on_double_eol is not supported; use stop_on_eol",
    "prevent_newline_after_colon": "prevent_newline_after_colon is not supported; drop it",
    "top_p_decay": "top_p_decay is not supported; drop it",
    "top_p_bound": "top_p_bound is not supported; drop it",
    "stop_token": "stop_token is not supported: generation stops at the tokenizer's end-of-document token",
}


@dataclass
class ApiJob:
    texts: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    logprobs: bool


_NEWLINES: dict[int, tuple[int, ...]] = {}


def newline_token_ids(tokenizer) -> tuple[int, ...]:
    """Ids of the tokens whose text holds a newline (what ``stop_on_eol`` stops at); computed once."""
    key = id(tokenizer)
    if key not in _NEWLINES:
        found = []
        for i in range(tokenizer.vocab_size):
            try:
                if "\n" in tokenizer.detokenize([i]):
                    found.append(i)
            except (KeyError, IndexError, ValueError):
                continue
        _NEWLINES[key] = tuple(found)
    return _NEWLINES[key]


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
    seed = get_int(body, "random_seed", -1, low=-1)
    get_bool(body, "no_log", False)
    if any(not t for t in texts) and not add_bos:
        raise RequestError("an empty prompt needs add_BOS=true")
    bos = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
    if add_bos and bos is None:
        raise RequestError("add_BOS: the tokenizer has no beginning- or end-of-document token")
    prompts = [([bos] if add_bos else []) + (tokenizer.tokenize(t) if t else []) for t in texts]
    params = SamplingParams(tokens_to_generate=n, temperature=temperature, top_k=top_k, top_p=top_p,
                            random_seed=None if seed < 0 else seed,
                            stop_token_ids=newline_token_ids(tokenizer) if stop_on_eol else ())
    return ApiJob(texts, prompts, params, logprobs)


def continuation_text(tokenizer, result) -> str:
    """The text the generated tokens add after the prompt's: decoded in context, so a tokenizer that
    puts spaces between tokens or marks word starts (SentencePiece) joins them as it would."""
    prompt = tokenizer.detokenize(result.tokens[:result.prompt_length])
    whole = tokenizer.detokenize(result.tokens)
    return whole[len(prompt):] if whole.startswith(prompt) else tokenizer.detokenize(result.generated)


def api_response(job: ApiJob, results, tokenizer) -> dict:
    """Megatron's response: text, segments, tokens (and logprobs when asked)."""
    out = {
        "text": [text + continuation_text(tokenizer, r) for text, r in zip(job.texts, results)],
        "segments": [[tokenizer.detokenize([t]) for t in r.tokens] for r in results],
        "tokens": [r.tokens for r in results],
    }
    if job.logprobs:
        out["logprobs"] = [r.log_probs for r in results]
    return out
