"""How the next token is chosen from the logits, and the sampling parameters of a request.

First OpenAI's ``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` adjust the logits
(:func:`adjust_logits`; greedy included). Then the order is Megatron's: ``top_k == 1`` is greedy
(the argmax of the logits, temperature ignored); otherwise the logits are divided by ``temperature``, then either the ``top_k`` largest are
kept or the smallest set of tokens whose probability reaches ``top_p`` (the most likely token is
always kept), and the token is drawn from the softmax of what remains with a seeded generator.
``top_k == 0`` and ``top_p == 0`` sample from the whole vocabulary; top-k and top-p together are
refused. The logits are shifted by their row maximum before the division, so a temperature small
enough to overflow the quotient is greedy (its limit: the most likely tokens only) instead of
inf / NaN. Logits holding NaN or inf (e.g. an fp16 overflow in the model) are refused with
:class:`NonFiniteLogitsError`.

The model's vocabulary may hold ids its tokenizer cannot print (:func:`unprintable_ids`: a vocabulary
padded past the tokenizer's, as Qwen's 151936 rows over 151665 tokens, a ``--tokenizer-type``
override, a vocab.json whose ids skip some): they are never chosen (set to -inf after the penalties
and the bias, so greedy, top-k and top-p choose among the printable ids only, with their
probabilities renormalised over them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

MAX_SEED = 2**64  # torch.Generator.manual_seed takes seeds below this


class NonFiniteLogitsError(RuntimeError):
    """The model's logits hold NaN or inf: no token can be chosen (not the request's fault)."""

    def __init__(self):
        super().__init__("the model's logits hold NaN or inf (e.g. an fp16 overflow: try --bf16 or fp32), "
                         "so no token can be sampled")


@dataclass
class SamplingParams:
    """What one generation call asks for (the fields of Megatron's ``PUT /api``)."""

    tokens_to_generate: int = 64
    """New tokens per prompt at most (0: only score the prompts)."""
    temperature: float = 1.0
    """Softmax temperature, in (0, 100]; not used when top_k is 1."""
    top_k: int = 0
    """1: greedy; k > 1: sample among the k most likely tokens; 0: no top-k filtering."""
    top_p: float = 0.0
    """Sample among the most likely tokens whose probability adds up to top_p (0: no filtering)."""
    random_seed: int | None = None
    """Reseed the sampling generator before this call (None: continue the engine's stream)."""
    stop_on_eod: bool = True
    """Stop a sequence at the tokenizer's end-of-document token."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """More token ids that end a sequence (kept in its output, like the end-of-document token)."""
    top_n_logprobs: int = 0
    """Also return the n most likely tokens and their log-probs at every position (0: none)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the sequence has generated so far (OpenAI's, in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Times how often the sequence has generated a token, subtracted from its logit (in [-2, 2])."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token id, bias)`` pairs: each bias, in [-100, 100], is added to that token's logit."""
    top_p_decay: float = 0.0
    """Megatron's: after each decode step ``top_p`` is multiplied by this (0: no decay; needs top_p)."""
    top_p_bound: float = 0.0
    """Megatron's: the decayed ``top_p`` never goes below this (0: no bound; at most top_p)."""
    double_stop_ids: tuple[int, ...] = field(default_factory=tuple)
    """A generated token of this set right after another one of it ends the sequence (stop_on_double_eol)."""
    ban_after_ids: tuple[int, ...] = field(default_factory=tuple)
    """After a token of this set, the tokens of ``banned_ids`` cannot be chosen (prevent_newline_after_colon)."""
    banned_ids: tuple[int, ...] = field(default_factory=tuple)
    """See ``ban_after_ids``."""
    beam_width: int = 0
    """> 0: Megatron's beam search with this many beams over one prompt (:mod:`.beam`); sampling fields unused."""
    length_penalty: float = 1.0
    """Beam search: a hypothesis scores ``sum of its log-probs / (generated length) ** length_penalty``."""
    beam_log_probs: bool = False
    """Beam search: score every hypothesis once more (one forward pass over them all), so its
    :class:`~.engine.Generation` holds ``log_probs`` (and ``top_log_probs`` with ``top_n_logprobs``)."""
    step_log_probs: bool = False
    """Broadcast each decode step's log-probs with its tokens (one more small tensor per step), so the
    engine's :meth:`~.engine.InferenceEngine.stream` hands them out as they come (streamed ``logprobs``)."""
    prompt_log_probs: bool = True
    """The answer's log-probs cover the prompt's tokens. False (OpenAI's routes unless ``echo`` with
    ``logprobs``, ``PUT /api`` without ``logprobs``) lets continuous batching start after prompt
    blocks it finds in its prefix cache, whose log-probs it then does not compute (NaN there)."""
    stop_strings: tuple[str, ...] = ()
    """OpenAI's ``stop``: a sequence ends at the generated token whose text completes one of these (the
    token kept; the answer cuts the text before the string), when the engine has a tokenizer on its
    sampling rank (:mod:`.stop_strings`); else it decodes on and only the answer is cut."""

    @property
    def penalized(self) -> bool:
        """Whether the presence or frequency penalty is on (the engine then counts generated tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check(self) -> None:
        """Raise ValueError with one line naming the field when a value is out of range."""
        if not isinstance(self.tokens_to_generate, int) or self.tokens_to_generate < 0:
            raise ValueError(f"tokens_to_generate must be an integer >= 0, got {self.tokens_to_generate!r}")
        if not 0.0 < self.temperature <= 100.0:
            raise ValueError(f"temperature must be in (0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= 1000:
            raise ValueError(f"top_k must be an integer in [0, 1000], got {self.top_k!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError("cannot set both top_k and top_p; use one of them")
        if self.random_seed is not None and (not isinstance(self.random_seed, int)
                                             or not 0 <= self.random_seed < MAX_SEED):
            raise ValueError(f"random_seed must be an integer in [0, 2^64) (a torch generator's seed), "
                             f"got {self.random_seed!r}")
        if not isinstance(self.top_n_logprobs, int) or not 0 <= self.top_n_logprobs <= 20:
            raise ValueError(f"top_n_logprobs must be an integer in [0, 20], got {self.top_n_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        self._check_megatron()
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token {token!r} must be an id >= 0 and its bias in [-100, 100], "
                                 f"got {bias!r}")


    def _check_megatron(self) -> None:
        if not 0.0 <= self.top_p_decay <= 1.0 or (self.top_p_decay > 0.0 and self.top_p == 0.0):
            raise ValueError(f"top_p_decay must be in [0, 1] and needs top_p > 0, got {self.top_p_decay!r}")
        if self.top_p_bound < 0.0 or self.top_p_bound > self.top_p:
            raise ValueError(f"top_p_bound must be in [0, top_p], got {self.top_p_bound!r}")
        if not isinstance(self.beam_width, int) or self.beam_width < 0:
            raise ValueError(f"beam_width must be an integer >= 0, got {self.beam_width!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


def decayed_top_p(params: SamplingParams) -> SamplingParams:
    """``params`` for the next decode step: ``top_p`` times ``top_p_decay``, at least ``top_p_bound``
    (Megatron's rule, applied after every step; unchanged without a decay)."""
    if params.top_p == 0.0 or params.top_p_decay == 0.0:
        return params
    top_p = params.top_p * params.top_p_decay
    return replace(params, top_p=max(top_p, params.top_p_bound) if params.top_p_bound > 0.0 else top_p)


def ban_after(logits: torch.Tensor, previous: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [b, V]`` with ``banned_ids`` set to -1e10 (as Megatron does: finite) in the rows whose ``previous [b]`` token is one
    of ``ban_after_ids`` (a copy; unchanged when nothing is banned)."""
    if not params.ban_after_ids or not params.banned_ids:
        return logits
    after = torch.tensor(params.ban_after_ids, dtype=torch.long, device=logits.device)
    banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    banned[torch.tensor([t for t in params.banned_ids if t < logits.shape[-1]], dtype=torch.long,
                        device=logits.device)] = True
    return logits.masked_fill(torch.isin(previous, after).unsqueeze(1) & banned, -1e10)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits [b, V]`` with everything below the k-th largest of each row set to -inf."""
    kth = logits.topk(min(k, logits.shape[-1]), dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits [b, V]`` keeping, per row, the most likely tokens until their probability reaches
    ``p`` (the token that crosses ``p`` is kept, and always the most likely one)."""
    ordered, order = logits.sort(dim=-1, descending=True)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative > p
    drop[:, 1:] = drop[:, :-1].clone()  # shift right: keep the token that crosses p
    drop[:, 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


def adjust_logits(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None) -> torch.Tensor:
    """OpenAI's penalties and bias: ``logits [b, V] - frequency_penalty * counts - presence_penalty *
    (counts > 0) + logit_bias``, where ``counts [b, V]`` is how often each sequence has generated each
    token (the prompt's tokens are not counted); applied before the temperature, as vLLM does."""
    if counts is not None and params.penalized:
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device)
        logits = logits.index_add(-1, ids, bias.expand(logits.shape[0], -1))
    return logits


def unprintable_ids(tokenizer, vocab_size: int) -> torch.Tensor | None:
    """``[vocab_size]`` bools: the model's token ids ``tokenizer`` cannot detokenize, those from its
    ``vocab_size`` on and, where it has an id -> token table (``inv_vocab``), the ids missing from it
    (GPT-2's decoder raises KeyError on them, SentencePiece IndexError, Hugging Face's prints nothing).
    None when there are none, or no tokenizer."""
    if tokenizer is None:
        return None
    mask = torch.arange(vocab_size) >= tokenizer.vocab_size
    table = getattr(tokenizer, "inv_vocab", None)
    if isinstance(table, dict):
        known = torch.zeros(vocab_size, dtype=torch.bool)
        known[torch.tensor([i for i in table if isinstance(i, int) and 0 <= i < vocab_size], dtype=torch.long)] = True
        mask |= ~known
    return mask if bool(mask.any()) else None


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           counts: torch.Tensor | None = None, unprintable: torch.Tensor | None = None) -> torch.Tensor:
    """The next token ``[b]`` of each row of ``logits [b, V]`` (the real vocabulary only);
    :class:`NonFiniteLogitsError` when a row holds NaN or inf."""
    tokens = sample_or_mark(logits, params, generator, counts, unprintable)
    if bool((tokens < 0).any()):
        raise NonFiniteLogitsError()
    return tokens


def sample_or_mark(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                   counts: torch.Tensor | None = None, unprintable: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`sample`, with -1 for a row whose logits hold NaN or inf instead of an error (the
    engine broadcasts the mark, so every rank raises together). ``counts``: see :func:`adjust_logits`;
    ``unprintable [V]``: ids never chosen (:func:`unprintable_ids`)."""
    bad = ~torch.isfinite(logits).all(dim=-1, keepdim=True)
    logits = sampling_logits(logits.masked_fill(bad, 0.0), params, counts, unprintable)
    if params.top_k == 1:
        chosen = logits.argmax(dim=-1)
    else:
        chosen = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)
    return chosen.masked_fill(bad.squeeze(1), -1)


def sampling_logits(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None = None,
                    unprintable: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [b, V]`` (finite) as the sampler draws from them: fp32, penalised and biased, the
    ``unprintable`` ids at -inf; unless greedy (``top_k == 1``: the argmax is taken of these) also
    divided by the temperature and top-k / top-p filtered, so their softmax is the distribution
    sampled (speculative decoding compares the draft's with the main model's)."""
    logits = adjust_logits(logits.float(), params, counts)
    if unprintable is not None:
        logits = logits.masked_fill(unprintable, float("-inf"))
    if params.top_k == 1:
        return logits
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature  # max 0: no overflow
    if params.top_k > 1:
        return filter_top_k(logits, params.top_k)
    if 0.0 < params.top_p < 1.0:
        return filter_top_p(logits, params.top_p)
    return logits
