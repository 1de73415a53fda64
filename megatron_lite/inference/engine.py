"""The static-batch inference engine: prefill, then one token per step with a key/value cache.

A batch of prompts of different lengths runs as Megatron's static batch: the first forward pass
(the *prefill*) covers the shortest prompt, then every step feeds one token per sequence - the
next prompt token where a sequence still has prompt left (teacher forcing), else the token just
sampled - so every sequence has the same length at every step and no padding mask is needed. A
sequence ends at the end-of-document token (or another stop token), or after
``tokens_to_generate`` new tokens; the batch ends when every sequence has. Each step's keys and
values are appended to the :class:`~megatron_lite.inference.kv_cache.KVCache`, so a step costs
one token's work; ``use_cache=False`` recomputes the whole prefix instead (the reference the
tests and the benchmark compare with).

Parallel layouts (one model replica over ``TP x PP`` ranks, every rank calling ``generate`` with
the same prompts): under tensor parallelism each rank runs its own heads and the vocabulary-split
logits are all-gathered; under pipeline parallelism each stage receives the previous stage's
hidden states, runs its layers with its own part of the cache and passes them on. The last stage
(its TP rank 0) samples from the gathered logits of the whole vocabulary (so OpenAI's penalties
and ``logit_bias`` index token ids directly; that rank alone counts the generated tokens the
penalties need), and the chosen tokens are broadcast to every rank, which feed them to the
first stage at the next step; the log-probs are broadcast once at the end, and with
``SamplingParams.step_log_probs`` also those each step computed, right after its tokens (every
rank takes part: the followers of a server run the same parameters).

``SamplingParams.beam_width`` > 0 runs Megatron's beam search over one prompt instead
(:mod:`.beam`), with the same cache and the same broadcasts.

Log-probs: ``log_probs[i]`` is ``log p(tokens[i + 1] | tokens[:i + 1])`` for every position of
the prompt and of the generated text (``len(tokens) - 1`` values), from the fp32 log-softmax over
the real vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.comm import _all_gather
from ..parallel.pipeline.p2p import PipeComm
from ..parallel.state import ParallelState
from .beam import beam_search
from .kv_cache import KVCache
from .sampling import (
    NonFiniteLogitsError,
    SamplingParams,
    ban_after,
    decayed_top_p,
    sample_or_mark,
    unprintable_ids,
)
from .stop_strings import broadcast_tokens, stop_checker


@dataclass
class Generation:
    """One sequence's result."""

    tokens: list[int]
    """The prompt followed by the generated tokens (a stop token included)."""
    prompt_length: int
    log_probs: list[float]
    """``log p(tokens[i + 1] | tokens[:i + 1])``, ``len(tokens) - 1`` values."""
    finish_reason: str = "length"
    """``stop`` (a stop token ended it) or ``length``."""
    top_log_probs: list[list[tuple[int, float]]] | None = None
    """Per position of ``log_probs``: the most likely ``(token, log-prob)`` pairs, best first."""
    greedy: list[bool] | None = None
    """Per position of ``log_probs``: whether the next token is the argmax (scoring only)."""
    score: float | None = None
    """Beam search: the hypothesis' score, ``sum of log-probs / generated length ** length_penalty``
    (its ``log_probs`` are then empty)."""

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length:]


class Step(list):
    """What :meth:`InferenceEngine.stream` yields after a step: every sequence's new token (None where
    it is still reading its prompt or has ended). With ``SamplingParams.step_log_probs`` it also holds
    the log-probs the step computed, positions ``[start, start + len(log_probs[i]))`` of sequence i
    (each step starts where the one before ended, the first at 0): ``log_probs[i][j]`` is
    ``log p(tokens[start + j + 1] | tokens[:start + j + 1])`` and ``top_log_probs`` (with
    ``top_n_logprobs``) its best ``(token, log-prob)`` pairs, as :class:`Generation` holds them."""

    start: int = 0
    log_probs: list[list[float]] | None = None
    top_log_probs: list[list[list[tuple[int, float]]]] | None = None


class InferenceEngine:
    """Generation and scoring with one model replica over ``state``'s TP x PP ranks.

    ``model`` is this rank's pipeline chunk (:func:`~megatron_lite.inference.loading.load_model`).
    ``vocab_size`` is the real vocabulary (logits of the padded rows are never used),
    ``max_sequence_length`` the longest prompt + generation allowed, ``eod`` the end-of-document
    token (None: no stop at end of document), ``seed`` the sampling generator's seed, ``tokenizer``
    (needed on the sampling rank only) ends a sequence at its ``SamplingParams.stop_strings`` as soon
    as they appear (:mod:`.stop_strings`; None: it decodes on, and the answer is cut afterwards), and
    keeps the ids it cannot print (:func:`~.sampling.unprintable_ids`: a model vocabulary larger than
    the tokenizer's) out of sampling, greedy choice, beam search and the top log-probs; the log-probs
    of given tokens stay those of the softmax over the whole ``vocab_size``.
    """

    def __init__(self, model, state: ParallelState | None = None, *, vocab_size: int, max_sequence_length: int,
                 eod: int | None = None, seed: int = 1234, use_cache: bool = True, tokenizer=None):
        self.model = model.eval()
        self.state = state if state is not None else ParallelState(world_size=1, rank=0)
        self.vocab_size, self.max_sequence_length = int(vocab_size), int(max_sequence_length)
        self.eod, self.use_cache, self.tokenizer = eod, use_cache, tokenizer
        self.device = next(model.parameters()).device
        self.unprintable = unprintable_ids(tokenizer, self.vocab_size)  # [vocab_size] bools, or None
        if self.unprintable is not None:
            self.unprintable = self.unprintable.to(self.device)
        self.dtype = next(model.parameters()).dtype
        # what pipeline stages exchange: the residual stream, fp32 under --fp32-residual-connection
        self.stream_dtype = torch.float32 if getattr(model.config, "fp32_residual_connection", False) else self.dtype
        self.hidden_size = model.config.hidden_size
        s = self.state
        self.src = s.grid.rank_of(pp=s.pp_size - 1, tp=0)  # samples and broadcasts
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.timings: dict[str, float] = {}

    @property
    def printable_size(self) -> int:
        """How many ids sampling can choose from (:attr:`vocab_size` less the unprintable ones)."""
        return self.vocab_size - (int(self.unprintable.sum()) if self.unprintable is not None else 0)

    # -- one forward pass over the pipeline ------------------------------------------------------
    @property
    def is_src(self) -> bool:
        return self.state.rank == self.src

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, **inputs) -> torch.Tensor | None:
        """Logits ``[b, s, vocab_size]`` (fp32, every vocabulary entry) of ``tokens [b, s]`` on the
        last pipeline stage, None on the others. With ``cache``, ``tokens`` follow the cached ones;
        ``inputs``: the model's ``position_ids`` and ``attention_mask`` (continuous batching's rows)."""
        s, b = tokens.shape[1], tokens.shape[0]
        state = self.state
        comm = PipeComm(state, (s, b, self.hidden_size), self.stream_dtype) if state.pp_size > 1 else None
        if not state.is_first_stage():
            self.model.set_input_tensor(comm.recv_forward())
        out = self.model(tokens, inference_context=cache, **inputs)
        if not state.is_last_stage():
            comm.send_forward(out)
            return None
        logits = _all_gather(out, -1, state.tp_group)  # [b, s, padded vocab]
        return logits[..., :self.vocab_size].float()

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the sampling rank holds it, on every rank."""
        if self.state.world_size > 1:
            dist.broadcast(tensor, self.src)
        return tensor

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, sequences: list[list[int]], top_n: int = 0) -> list[Generation]:
        """Log-probs (and greedy flags, and the ``top_n`` best tokens) of every token of each sequence
        given the ones before it: one forward pass over all but the last token, no generation (so a
        sequence may be one token longer than ``max_sequence_length``)."""
        _check_prompts(sequences, self.max_sequence_length + 1, vocab_size=self.vocab_size)
        b, total = len(sequences), max(len(t) for t in sequences)
        tokens = pad_prompts(sequences, total, self.device)
        values = torch.zeros(b, total - 1, 2 + 2 * top_n, device=self.device)
        logits = self.forward(tokens[:, :-1]) if total > 1 else None
        if logits is not None:
            values = position_stats(logits, tokens[:, 1:], top_n, self.unprintable)
        values = self._broadcast(values.contiguous()).cpu()
        return [generation_result(seq, len(seq), values[i, :len(seq) - 1], top_n, "length", greedy=True)
                for i, seq in enumerate(sequences)]

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[Generation]:
        """Continue every prompt (token ids, at least one each); see the module docstring."""
        steps = self.stream(prompts, params)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value

    def stream(self, prompts: list[list[int]], params: SamplingParams | None = None):
        """:meth:`generate` one decode step at a time: the prompts and parameters are checked now
        (ValueError), then the generator yields, after each step, a :class:`Step` (every sequence's new
        token, None where it is still reading its prompt or has ended) and returns the list of
        :class:`Generation`. Every rank must run it to the end: each step is a collective."""
        params = params if params is not None else SamplingParams()
        params.check()
        _check_prompts(prompts, self.max_sequence_length, params.tokens_to_generate, self.vocab_size)
        check_vocabulary(params, self.vocab_size, self.printable_size)  # before any collective: every rank raises
        if params.tokens_to_generate == 0:
            return _scored(self.score(prompts, params.top_n_logprobs))
        if params.beam_width:
            return _scored(self._beams(prompts, params))
        return self._steps(prompts, params)

    def _beams(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Beam search's hypotheses, best first; with ``params.beam_log_probs`` scored once more (one
        forward pass over them all) for their log-probs."""
        found = [Generation(t, len(prompts[0]), [], "stop" if stopped else "length", score=score)
                 for t, score, stopped in beam_search(self, prompts, params)]
        if params.beam_log_probs:
            for beam, scored in zip(found, self.score([b.tokens for b in found], params.top_n_logprobs)):
                beam.log_probs, beam.top_log_probs = scored.log_probs, scored.top_log_probs
        return found

    def _steps(self, prompts: list[list[int]], params: SamplingParams):
        n = params.tokens_to_generate
        if params.random_seed is not None:
            self.generator.manual_seed(params.random_seed)
        b = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        total = int(lengths.max()) + n
        tokens = pad_prompts(prompts, total, self.device)
        stop_ids = set(params.stop_token_ids) | ({self.eod} if params.stop_on_eod and self.eod is not None else set())
        stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)
        top_n = params.top_n_logprobs
        values = torch.zeros(b, total - 1, 2 + 2 * top_n, device=self.device)
        ends = lengths + n  # exclusive end of each sequence, lowered when it stops
        stopped = torch.zeros(b, dtype=torch.bool, device=self.device)
        cache = KVCache(b, total) if self.use_cache else None
        counts = torch.zeros(b, self.vocab_size, device=self.device) if params.penalized and self.is_src else None
        prev, t0, checker = 0, time.perf_counter(), stop_checker(self, prompts, params)
        for cur in range(int(lengths.min()), total):
            logits = self.forward(tokens[:, prev:cur] if cache is not None else tokens[:, :cur], cache)
            if cache is not None:
                cache.advance(cur - prev)
            new = torch.zeros(b, dtype=torch.long, device=self.device)
            if self.is_src:
                last = ban_after(logits[:, -1], tokens[:, cur - 1], params)
                new = torch.where(cur < lengths, tokens[:, cur], sample_or_mark(last, params, self.generator, counts,
                                                                                 self.unprintable))
            params = decayed_top_p(params)
            live = (cur < ends) & (cur >= lengths)  # the sequences whose new token is generated text
            new, hit = broadcast_tokens(self, new, bool(params.stop_strings), [(checker, live)])
            non_finite = (new < 0).any()  # the sampling rank's logits held NaN / inf: raised at the sync below,
            new = new.clamp(min=0)  # ... the mark kept out of the tokens meanwhile
            finished = cur >= ends
            tokens[:, cur] = torch.where(finished, tokens[:, cur], new)
            if logits is not None:
                values[:, prev:cur] = position_stats(logits[:, -(cur - prev):], tokens[:, prev + 1:cur + 1], top_n,
                                                      self.unprintable)
            stop_here = live & (torch.isin(new, stops) | _double_stop(new, tokens[:, cur - 1], params) | hit)
            stopped |= stop_here
            ends = torch.where(stop_here, cur + 1, ends)
            emitted = ~finished & (cur >= lengths)
            if counts is not None:  # the generated tokens the penalties count (the sampling rank only)
                counts.scatter_add_(1, new.unsqueeze(1), emitted.unsqueeze(1).float())
            synced = torch.cat([torch.stack([non_finite, (cur + 1 >= ends).all()]).long(), emitted.long(), new]).tolist()
            bad, done = synced[:2]  # one wait for the device per step
            if bad:  # every rank raises together (the mark was broadcast)
                raise NonFiniteLogitsError()
            if prev == 0:
                self.timings["prefill_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
            step = Step(t if e else None for e, t in zip(synced[2:2 + b], synced[2 + b:]))
            if params.step_log_probs:
                _step_log_probs(step, self._broadcast(values[:, prev:cur].contiguous()).cpu(), prev, top_n)
            prev = cur
            yield step
            if done:
                break
        self.timings.update(decode_s=time.perf_counter() - t0, decode_steps=cur - int(lengths.min()))
        values = self._broadcast(values.contiguous()).cpu()
        tokens, ends = tokens.cpu(), ends.tolist()
        return [generation_result(tokens[i, :ends[i]].tolist(), len(prompts[i]), values[i, :ends[i] - 1], top_n,
                        "stop" if stopped[i] else "length") for i in range(b)]


def _step_log_probs(step: Step, values: torch.Tensor, start: int, top_n: int) -> None:
    """``step`` given the log-probs ``values [b, n, 2 + 2 top_n]`` of positions ``[start, start + n)``."""
    step.start, step.log_probs = start, values[..., 0].tolist()
    if top_n:
        ids, best = values[..., 2 + top_n:].long().tolist(), values[..., 2:2 + top_n].tolist()
        step.top_log_probs = [[list(zip(i, v)) for i, v in zip(row_ids, row)] for row_ids, row in zip(ids, best)]


def _scored(results: list[Generation]):
    """A generator of no steps that returns ``results`` (``tokens_to_generate`` 0: scoring only)."""
    return results
    yield  # noqa: B901 - unreachable: makes this function a generator


def _double_stop(new: torch.Tensor, previous: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Where ``new`` and the token before it are both of ``params.double_stop_ids`` (stop_on_double_eol)."""
    pair = torch.tensor(params.double_stop_ids, dtype=torch.long, device=new.device)
    return torch.isin(new, pair) & torch.isin(previous, pair)


def check_vocabulary(params: SamplingParams, vocab_size: int, printable: int | None = None) -> None:
    """ValueError (on every rank, before any collective) for fields that name more of the vocabulary
    than there is: a ``logit_bias`` token id, or more top log-probs than (``printable``) tokens (which
    only the last pipeline stage would notice)."""
    if any(t >= vocab_size for t, _ in params.logit_bias):
        raise ValueError(f"logit_bias: a token id is outside the vocabulary [0, {vocab_size})")
    for name in ("stop_token_ids", "double_stop_ids", "ban_after_ids", "banned_ids"):
        bad = [t for t in getattr(params, name) if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:  # a negative id would count from the vocabulary's end, a huge one overflow a tensor
            raise ValueError(f"{name}: token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    printable = vocab_size if printable is None else printable
    if params.top_n_logprobs > printable:
        raise ValueError(f"top_n_logprobs {params.top_n_logprobs} is more than the vocabulary's {printable} tokens")


def _check_prompts(prompts, max_length: int, new_tokens: int = 0, vocab_size: int | None = None) -> None:
    """ValueError (one line) for no prompts, an empty one, one too long for the model, or one holding a
    token id outside ``[0, vocab_size)`` (e.g. from a tokenizer larger than the model's vocabulary:
    the model has no logit for it, and an id past its embedding cannot even be read)."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty (it needs at least one token, e.g. the end-of-document token)")
        if len(p) + new_tokens > max_length:
            extra = f" + {new_tokens} tokens to generate" if new_tokens else ""
            raise ValueError(f"prompt {i} has {len(p)} tokens{extra}, more than the model's {max_length} "
                             "(--max-sequence-length, or lm-eval's max_length, where given; else the checkpoint's "
                             "--max-position-embeddings with learned positions or its --seq-length with rotary ones): "
                             "shorten it or generate fewer tokens")
        bad = [t for t in p if not 0 <= t < vocab_size] if vocab_size is not None else []
        if bad:
            raise ValueError(f"prompt {i} holds token id {bad[0]}, outside the model's vocabulary [0, {vocab_size}) "
                             "(a tokenizer with more tokens than the model was trained with?)")


def pad_prompts(sequences: list[list[int]], total: int, device) -> torch.Tensor:
    tokens = torch.zeros(len(sequences), total, dtype=torch.long)
    for i, seq in enumerate(sequences):
        tokens[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    return tokens.to(device)


def position_stats(logits: torch.Tensor, targets: torch.Tensor, top_n: int,
                    unprintable: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, s, 2 + 2 top_n]``: the target's log-prob, whether it is the argmax, then the ``top_n``
    best log-probs and their token ids (as floats: one tensor to broadcast), ``unprintable`` ids left
    out of those (the log-probs are still over the whole vocabulary, as is the argmax)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1))
    greedy = (logits.argmax(dim=-1) == targets).unsqueeze(-1).float()
    parts = [chosen, greedy]
    if top_n:
        best = (logp if unprintable is None else logp.masked_fill(unprintable, float("-inf"))).topk(top_n, dim=-1)
        parts += [best.values, best.indices.float()]
    return torch.cat(parts, dim=-1)


def generation_result(tokens, prompt_length, values, top_n, finish_reason, greedy=False) -> Generation:
    top = None
    if top_n:
        ids = values[:, 2 + top_n:].long().tolist()
        top = [list(zip(i, v)) for i, v in zip(ids, values[:, 2:2 + top_n].tolist())]
    return Generation(list(tokens), prompt_length, values[:, 0].tolist(), finish_reason, top,
                      [bool(g) for g in values[:, 1].tolist()] if greedy else None)
