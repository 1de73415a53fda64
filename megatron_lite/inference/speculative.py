"""Speculative decoding with the model's own multi-token prediction heads (DeepSeek-V3's
self-speculation; vLLM's ``num_speculative_tokens``).

A model trained with ``--mtp-num-layers D`` holds D extra depths: depth ``k`` at position ``i``
predicts token ``t(i + k + 1)`` (:mod:`megatron_lite.models.mtp`). With ``N <= D`` speculative
tokens, each decode *round*, the tokens known up to ``t(n)`` (the main model's latest, which it has
not read yet):

1. **draft**: depth 1 at position ``n - 1`` reads the main model's output there and ``t(n)`` and
   proposes ``d1`` for ``t(n + 1)``; depth ``k`` reads depth ``k - 1``'s output and ``d(k-1)`` and
   proposes ``dk`` for ``t(n + k)``;
2. **verify**: the main model reads ``[t(n), d1, .., dN]`` at positions ``n .. n + N`` in one forward
   pass (its key/value cache extended by ``N + 1`` entries): row ``i`` gives the distribution of
   ``t(n + i + 1)`` given the drafts before it;
3. **accept**: greedy (``top_k == 1``), the longest prefix of drafts equal to the main model's argmax,
   then the main model's own token after it, so a round emits 1 to ``N + 1`` tokens and the output is
   greedy decoding's, token for token. Sampling: standard speculative sampling (Leviathan et al.,
   Chen et al., 2023): draft ``dk``, drawn from its depth's distribution ``q``, is kept with
   probability ``min(1, p(dk) / q(dk))``; the first one refused is replaced by a draw from ``max(0, p
   - q)`` renormalised; when all are kept, one more token is drawn from ``p``. Each token is then
   distributed as the main model's sampling distribution ``p`` (the temperature, top-k and top-p
   applied to both ``p`` and ``q``, :func:`~.sampling.sampling_logits`), though the draws differ from
   the non-speculative engine's for the same seed.

Batches. Several prompts decode together: each sequence is a row of the caches (a
:class:`~.mtp_drafter.RowCache`, whose rows have their own lengths, positions and attention masks),
each round drafts for every sequence still running, verifies them all in one forward pass of the
main model (``N + 1`` tokens per row; a sequence near its end uses only the drafts within it) and
accepts per sequence, each keeping its own number of drafts.

Caches. After a round in which a sequence kept ``a`` drafts its row of the main cache is cut back to
``n + a + 1`` entries (the refused drafts' entries are written over next round). Each
depth has a cache of its own, since its attention sees its earlier positions as in training: depth
``k``'s entry ``j`` reads ``t(j + k)`` and depth ``k - 1``'s output at ``j``, so it is final once
``t(j + k)`` is an accepted token. Each round depth ``k`` runs over positions ``[f_k, n)``, ``f_k``
the first of its entries not yet final: the positions the last verify step added, and up to ``k - 1``
before them that had read a draft. It keeps its outputs by position, so the next depth reads them
from ``f_(k+1) <= f_k`` on.

Tensor parallelism: each rank runs its heads and all-gathers the logits of the vocabulary it holds,
so every rank drafts, verifies and accepts alike (the same logits; greedy needs nothing more, and
sampling draws from each rank's generator, seeded alike and drawn from in the same order); no
pipeline parallelism (the drafts need the last stage's outputs and the first stage's embedding).

With the key/value cache; beam search, stop
strings, the penalties, ``logit_bias``, ``top_p_decay``, the ban/double-stop fields and per-step
log-probs are refused (:func:`check_speculative_request`), or with ``fall_back`` set (the server's
``--num-speculative-tokens``) run by the plain engine instead. ``stream``'s ``cancelled`` (the server's
streaming client left) ends a request after the verify step in hand. ``timings`` reports the last
request's acceptance, ``served`` the totals since the engine was built.
"""

from __future__ import annotations

import time

import torch

from ..parallel.comm import _all_gather
from .engine import (
    Generation,
    InferenceEngine,
    Step,
    _check_prompts,
    check_vocabulary,
    generation_result,
    position_stats,
)
from .mtp_drafter import MTPDrafter, row_cache
from .sampling import NonFiniteLogitsError, SamplingParams, sampling_logits

UNSUPPORTED = {  # SamplingParams field -> what it is called in the message
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias",
    "top_p_decay": "top_p_decay", "double_stop_ids": "stop_on_double_eol", "ban_after_ids":
    "prevent_newline_after_colon", "stop_strings": "stop strings", "step_log_probs": "streamed log-probs",
}


def check_speculative_model(model, state, num_tokens: int, use_cache: bool = True) -> None:
    """ValueError (one line naming ``--num-speculative-tokens``) unless ``model`` can draft
    ``num_tokens`` tokens here: it has that many multi-token prediction depths, no pipeline parallelism splits it
    and the key/value cache is on."""
    depths = len(model.mtp.layers) if getattr(model, "mtp", None) is not None else 0
    if num_tokens < 1:
        raise ValueError(f"--num-speculative-tokens {num_tokens} must be at least 1 (or left out: no speculation)")
    if state.world_size > getattr(state, "tp_size", 1):
        raise ValueError("--num-speculative-tokens runs in one process or with tensor parallelism only (no "
                         "pipeline parallelism): pass --pipeline-model-parallel-size 1 and --tensor-model-parallel-size "
                         f"{state.world_size}")
    if depths == 0:
        raise ValueError(f"--num-speculative-tokens {num_tokens}: the model has no multi-token prediction heads to "
                         "draft with (it was not trained with --mtp-num-layers); leave the flag out")
    if num_tokens > depths:
        raise ValueError(f"--num-speculative-tokens {num_tokens}: the model has {depths} multi-token prediction "
                         f"head(s) (--mtp-num-layers {depths}); pass at most {depths}")
    if not use_cache:
        raise ValueError("--num-speculative-tokens needs the key/value cache; leave out --no-kv-cache")


def speculation_refusal(prompts: list[list[int]], params: SamplingParams) -> str | None:
    """Why speculative decoding cannot run this request (one line), or None when it can."""
    if params.beam_width:
        return "beam search does not run with speculative decoding (--num-speculative-tokens)"
    default = SamplingParams()
    for name, what in UNSUPPORTED.items():
        if getattr(params, name) != getattr(default, name):
            return f"{what} is not supported with speculative decoding (--num-speculative-tokens)"
    return None


def check_speculative_request(prompts: list[list[int]], params: SamplingParams) -> None:
    """ValueError (one line) for what speculative decoding does not support."""
    refusal = speculation_refusal(prompts, params)
    if refusal is not None:
        raise ValueError(refusal)


def speculative_accept(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int],
                       generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling: ``(kept, token)``, how many of ``drafts`` are kept and the token after them.
    ``p [len(drafts) + 1, V]``: the target's probabilities at each draft and after the last; ``q
    [len(drafts), V]``: the distributions the drafts were drawn from (every row of both normalised)."""
    if drafts:
        rows = torch.arange(len(drafts), device=p.device)
        d = torch.tensor(drafts, device=p.device)
        u = torch.rand(len(drafts), generator=generator, device=p.device)
        kept = (u * q[rows, d] < p[rows, d]).tolist()  # u < p / q: kept with probability min(1, p / q)
        for i, keep in enumerate(kept):
            if not keep:
                residual = (p[i] - q[i]).clamp(min=0)
                if not bool(residual.sum() > 0):  # p == q in floating point: no refusal is possible then
                    residual = p[i]
                return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


class SpeculativeEngine(InferenceEngine):
    """:class:`~.engine.InferenceEngine` whose greedy and sampled generation drafts
    ``num_speculative_tokens`` tokens per step with the model's multi-token prediction heads (scoring
    is unchanged). ``timings`` gains ``verify_steps``, ``drafted``, ``accepted`` and ``tokens`` (those the
    verify steps emitted; ``tokens / verify_steps`` is the tokens per verify step); ``served`` adds them
    up over every speculative request (``requests``) and counts those the plain engine ran
    (``fell_back``). A request speculation does not support (:func:`speculation_refusal`) is refused
    (ValueError), or with ``fall_back`` (the server's) generated by the plain engine's steps."""

    cancellable = True  # stream() takes ``cancelled`` (the server's streaming client left)

    def __init__(self, model, state=None, *, num_speculative_tokens: int, fall_back: bool = False, **kwargs):
        super().__init__(model, state, **kwargs)
        check_speculative_model(self.model, self.state, num_speculative_tokens, self.use_cache)
        self.num_speculative_tokens, self.fall_back = num_speculative_tokens, fall_back
        self.served = dict(requests=0, fell_back=0, verify_steps=0, drafted=0, accepted=0, tokens=0)

    def speculates(self, prompts: list[list[int]], params: SamplingParams) -> bool:
        """Whether this request generates with drafts (else it is refused, or falls back)."""
        return speculation_refusal(prompts, params) is None

    def joinable(self, prompts: list[list[int]], params: SamplingParams) -> bool:
        """Whether this request may run in one speculative batch with others of equal ``params`` (the
        server's concurrent requests): it speculates, it is valid (else it runs alone, for its 400) and
        it draws no seeded sample (its seed gives the draws it gives alone)."""
        if not self.speculates(prompts, params) or (params.random_seed is not None and params.top_k != 1):
            return False
        try:
            params.check()
            _check_prompts(prompts, self.max_sequence_length, params.tokens_to_generate, self.vocab_size)
            check_vocabulary(params, self.vocab_size, self.printable_size)
        except ValueError:
            return False
        return params.tokens_to_generate > 0

    def stream(self, prompts: list[list[int]], params: SamplingParams | None = None, cancelled=None):
        """:meth:`InferenceEngine.stream <.engine.InferenceEngine.stream>`; ``cancelled()`` (rank 0's; the
        server's: the streaming client left) True ends a request with drafts after the verify step in
        hand, a set of sequence indices those sequences (every rank at the same step: rank 0's answer is
        broadcast); the request's caches are freed when it ends."""
        params = params if params is not None else SamplingParams()
        if not self.fall_back:
            check_speculative_request(prompts, params)
        self._cancelled = cancelled
        try:
            steps = super().stream(prompts, params)
        finally:
            self._cancelled = None
        if not self.speculates(prompts, params):
            self.served["fell_back"] += 1
        return steps

    def _steps(self, prompts: list[list[int]], params: SamplingParams):
        if self.speculates(prompts, params):
            return self._speculative_steps(prompts, params, getattr(self, "_cancelled", None))
        return super()._steps(prompts, params)

    def _main(self, cache, rows: list[int], ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model over ``ids`` (as many per row) after each of ``rows``' cached tokens: fp32
        logits ``[b, s, vocab_size]``, outputs ``[s, b, h]``."""
        s = len(ids[0])
        positions, mask = cache.begin(rows, s, self.device)
        positions = positions.clamp(max=self.max_sequence_length - 1)  # a row's unused drafts past its end
        with torch.no_grad():
            logits, hidden = self.model(torch.tensor(ids, device=self.device), positions, mask, inference_context=cache,
                                        return_hidden=True)
            logits = _all_gather(logits, -1, self.state.tp_group)  # [b, s, padded vocab] on every rank
        cache.advance()
        return logits[:, :, :self.vocab_size].float(), hidden

    def _accept(self, logits: torch.Tensor, drafts: list[int], q, params: SamplingParams) -> tuple[int, int]:
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogitsError()
        target = sampling_logits(logits, params, None, self.unprintable)
        if params.top_k != 1:
            return speculative_accept(target.softmax(dim=-1), q, drafts, self.generator)
        best = target.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == best[kept]:
            kept += 1
        return kept, best[kept]

    def _stop_asked(self, cancelled, b: int) -> list[bool]:
        """Per sequence, whether rank 0's ``cancelled()`` stops it (True: every one; else the indices of
        those it stops), on every rank (one broadcast under tensor parallelism)."""
        asked = cancelled() if cancelled is not None else False
        flags = [asked is True or (asked not in (False, None) and r in asked) for r in range(b)]
        if self.state.world_size == 1:
            return flags
        return [bool(x) for x in self._broadcast(torch.tensor(flags, dtype=torch.long, device=self.device)).tolist()]

    @torch.no_grad()
    def _speculative_steps(self, prompts: list[list[int]], params: SamplingParams, cancelled=None):
        if params.random_seed is not None:
            self.generator.manual_seed(params.random_seed)
        depths, b = self.num_speculative_tokens, len(prompts)
        stops = set(params.stop_token_ids) | ({self.eod} if params.stop_on_eod and self.eod is not None else set())
        length = max(len(p) for p in prompts) + params.tokens_to_generate + depths  # unused drafts pass a row's end
        main, drafter = row_cache(b, length), MTPDrafter(self, depths, length, params, b)
        seqs = [_Sequence(p, params, self.device) for p in prompts]
        counts = dict(verify_steps=0, drafted=0, accepted=0, tokens=0)
        t0 = time.perf_counter()
        for r, seq in enumerate(seqs):  # the prefills, one row at a time (their lengths differ)
            logits, hidden = self._main(main, [r], [seq.tokens])
            seq.read(logits[0], hidden[:, 0])
        live, first = list(range(b)), True
        while True:
            news = {r: self._round(seqs[r], r, params, main, drafter, counts, stops) for r in live}
            for j in range(max(len(new) for new in news.values())):  # one Step per token, None where none
                yield Step(news[r][j] if r in news and j < len(news[r]) else None for r in range(b))
            if first:
                self.timings["prefill_s"], t0, first = time.perf_counter() - t0, time.perf_counter(), False
            gone = self._stop_asked(cancelled, b) if cancelled is not None or self.state.world_size > 1 else [False] * b
            live = [r for r in live if seqs[r].finish is None and not gone[r]]  # ended, or its client left
            if not live:
                break
            count = min(depths, max(seqs[r].end - len(seqs[r].tokens) - 1 for r in live))
            drafts = drafter.draft({r: seqs[r].tokens for r in live}, count)
            logits, hidden = self._main(main, live, [[seqs[r].tokens[-1]] + drafts[r][0] for r in live])
            for j, r in enumerate(live):
                seqs[r].read(logits[j], hidden[:, j], *drafts[r])
        self.timings.update(decode_s=time.perf_counter() - t0, decode_steps=counts["verify_steps"], **counts)
        for name, add in dict(counts, requests=1).items():
            self.served[name] += add
        return [seq.result(params.top_n_logprobs) for seq in seqs]

    def _round(self, seq: _Sequence, r: int, params, main, drafter, counts, stops) -> list[int]:
        """Accept row ``r``'s drafts after its last forward pass (the prefill: none); record the tokens
        it emits (up to a stop token or its end) and return them."""
        start = len(seq.tokens) - 1 if seq.drafts is not None else 0
        usable = min(len(seq.drafts or []), seq.end - len(seq.tokens) - 1)  # drafts within its end
        drafts, q = (seq.drafts or [])[:usable], None if seq.q is None else seq.q[:usable]
        kept, token = self._accept(seq.logits[:usable + 1] if start else seq.logits[-1:], drafts, q, params)
        new = drafts[:kept] + [token]
        if start:  # a verify step: forget the refused drafts
            main.lengths[r] = start + kept + 1
            drafter.commit(r, start, kept)
            for name, add in (("verify_steps", 1), ("drafted", usable), ("accepted", kept), ("tokens", kept + 1)):
                counts[name] += add
        drafter.record_main(r, start, seq.hidden[:len(seq.tokens) - start + kept])
        targets = seq.tokens[start + 1:] + new
        seq.values[start:start + len(targets)] = position_stats(
            seq.logits[None, :len(targets)], torch.tensor([targets], device=self.device), params.top_n_logprobs,
            self.unprintable)[0]
        return seq.emit(new, stops)


class _Sequence:
    """One sequence of a speculative batch: its tokens, log-probs, last forward pass and drafts."""

    def __init__(self, prompt: list[int], params: SamplingParams, device):
        self.prompt_length, self.tokens = len(prompt), list(prompt)
        self.end = len(prompt) + params.tokens_to_generate
        self.values = torch.zeros(self.end - 1, 2 + 2 * params.top_n_logprobs, device=device)
        self.finish: str | None = None
        self.drafts: list[int] | None = None  # None: its last pass was the prefill

    def read(self, logits, hidden, drafts=None, q=None) -> None:
        """Its last forward pass: logits ``[s, V]`` and outputs ``[s, h]``, over the drafts ``drafts``."""
        self.logits, self.hidden, self.drafts, self.q = logits, hidden, drafts, q

    def emit(self, new: list[int], stops: set) -> list[int]:
        """Append ``new`` up to a stop token or the end; the tokens appended."""
        for i, token in enumerate(new):
            self.tokens.append(token)
            if token in stops or len(self.tokens) == self.end:
                self.finish = "stop" if token in stops else "length"
                return new[:i + 1]
        return new

    def result(self, top_n: int) -> Generation:
        values = self.values.cpu()
        return generation_result(self.tokens, self.prompt_length, values[:len(self.tokens) - 1], top_n,
                                 self.finish or "length")


def served_line(served: dict, num_tokens: int) -> str:
    """The server's speculation totals (:attr:`SpeculativeEngine.served`) in one line."""
    steps, drafted = served["verify_steps"], served["drafted"]
    kept = f", {100 * served['accepted'] / drafted:.0f}% of {drafted} drafts accepted" if drafted else ""
    per_step = f", {served['tokens'] / steps:.2f} tokens per verify step" if steps else ""
    return (f"speculative decoding ({num_tokens} token(s) per draft): {served['requests']} request(s) with drafts"
            f"{per_step}{kept}; {served['fell_back']} without (fields it does not support)")
