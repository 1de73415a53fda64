"""Beam search on the OpenAI-compatible routes, as vLLM's OpenAI server takes it.

``"use_beam_search": true`` runs the beam search of Megatron's ``PUT /api`` (:mod:`.beam`) over each
prompt, with ``best_of`` beams (default ``n``, as vLLM's newer servers take ``n`` for the beam width)
and returns the ``n`` best hypotheses of each prompt as its ``n`` choices, best first (choice
``i * n + j`` is prompt i's j-th best, as OpenAI numbers ``n`` choices). ``length_penalty`` (1.0)
divides a hypothesis' summed log-probs by its generated length (a stop token included, Megatron's
rule) ``** length_penalty``. ``finish_reason`` is ``stop`` when a stop token (or a ``stop`` string,
cut as for sampled text) ended the hypothesis, else ``length``; ``usage.completion_tokens`` counts
the tokens of the choices returned. With ``logprobs`` the hypotheses are scored by one more
forward pass, so every choice carries its tokens' log-probs (as vLLM returns them).

Refused with HTTP 400: ``stream`` (the beams are known only at the end), ``max_tokens`` 0,
``length_penalty`` other than 1 without beam search, and the sampling fields beam search cannot
honour unless they hold their neutral value: ``temperature`` (absent, 0 as older vLLM servers
required, or 1: the model's log-probs), ``top_p`` 1, ``top_k`` 0 or -1, ``seed``,
``presence_penalty`` / ``frequency_penalty`` 0 and an empty ``logit_bias``.
"""

from __future__ import annotations

import math

from .fields import RequestError, get_bool, get_number
from .sampling import SamplingParams

BEAM_FIELDS = {"use_beam_search", "length_penalty"}
MAX_BEAMS = 128
NEUTRAL = {"top_p": (1.0,), "top_k": (0, -1), "seed": (), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
           "logit_bias": ({},), "temperature": (0.0, 1.0)}


def beam_job(body, job):
    """``job`` (an :class:`~.api_openai.OpenAIJob`) marked for beam search when ``body`` asks for it;
    ``length_penalty`` read and the fields beam search cannot honour refused. The beam width is set
    later, with ``n`` and ``best_of`` (:func:`beam_params`)."""
    job.beam = get_bool(body, "use_beam_search", False)
    penalty = get_number(body, "length_penalty", 1.0)
    if not math.isfinite(penalty):
        raise RequestError(f"length_penalty must be a finite number, got {penalty!r}")
    if not job.beam:
        if penalty != 1.0:
            raise RequestError("length_penalty applies to beam search only; set use_beam_search=true or drop it")
        return job
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            allowed = " or ".join(str(v) for v in neutral) or "null"
            raise RequestError(f"{name} does not apply to beam search (use_beam_search); drop it or send {allowed}")
    if job.params.tokens_to_generate < 1:
        raise RequestError("use_beam_search needs max_tokens >= 1")
    job.params = SamplingParams(tokens_to_generate=job.params.tokens_to_generate, length_penalty=penalty,
                                top_n_logprobs=job.params.top_n_logprobs, beam_log_probs=job.logprobs is not None)
    return job


def beam_params(job, vocab: int) -> None:
    """The beam width of a beam-search ``job``: ``best_of`` (default ``n``), at most the vocabulary
    less its end-of-document token."""
    high = min(MAX_BEAMS, vocab - 1)
    if job.best_of > high:
        what = "n" if job.best_of == job.n else "best_of"
        raise RequestError(f"{what} is the beam width with use_beam_search: at most {high}, got {job.best_of}")
    job.params.beam_width = job.best_of


def run_beams(run, job):
    """The results of a beam-search ``job``: ``run([prompt], params)`` once per prompt (beam search
    continues one prompt at a time), each prompt's ``best_of`` hypotheses in a row, best first."""
    return [r for prompt in job.prompts for r in run([prompt], job.params)]


def best_beams(job, candidates: list) -> list:
    """Each prompt's first ``n`` of its ``best_of`` hypotheses (they come best first), numbered ``i * n + j``."""
    kept = [c for start in range(0, len(candidates), job.best_of) for c in candidates[start:start + job.n]]
    for index, (choice, _, _) in enumerate(kept):
        choice["index"] = index
    return kept
