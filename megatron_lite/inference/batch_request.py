"""One request of the continuous batch (:mod:`.scheduler`): the state the one-at-a-time engine keeps
for a request, for the cache rows it holds.

:class:`Admission` is a request entering the batch; :class:`BatchRequest` samples, records and
reports its sequences step by step (a sequence that ended gives its cache row back at once, so a
forward pass covers only :meth:`BatchRequest.held` and :func:`every_sequence` puts the logits back
in sequence order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import Generation, InferenceEngine, generation_result, pad_prompts, position_stats
from .sampling import SamplingParams, ban_after, decayed_top_p, sample_or_mark
from .stop_strings import stop_checker


@dataclass
class Admission:
    """A request entering the batch: its id, token ids and (checked) sampling parameters."""

    rid: int
    prompts: list[list[int]]
    params: SamplingParams


class BatchRequest:
    """One admitted request: the state :meth:`InferenceEngine._steps` keeps, for its rows only."""

    def __init__(self, engine: InferenceEngine, admission: Admission, rows: list[int], cached: int = 0):
        p, device = admission.params, engine.device
        self.rid, self.params = admission.rid, p
        self.rows: list[int | None] = list(rows)  # each sequence's cache row (None once it ended: freed)
        self.prompt_lengths = [len(x) for x in admission.prompts]
        self.lengths = torch.tensor(self.prompt_lengths, device=device)
        n, b = p.tokens_to_generate, len(rows)
        self.total = max(self.prompt_lengths) + n
        self.tokens = pad_prompts(admission.prompts, self.total, device)
        stop_ids = set(p.stop_token_ids) | ({engine.eod} if p.stop_on_eod and engine.eod is not None else set())
        self.stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self.values = torch.zeros(b, self.total - 1, 2 + 2 * p.top_n_logprobs, device=device)
        self.values[:, :cached, 0] = float("nan")  # a cached prompt prefix: its log-probs are not computed
        self.ends = self.lengths + n
        self.stopped = torch.zeros(b, dtype=torch.bool, device=device)
        self.counts = torch.zeros(b, engine.vocab_size, device=device) if p.penalized and engine.is_src else None
        self.generator, self.unprintable = engine.generator, engine.unprintable
        if p.random_seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(p.random_seed)
        self.prev, self.cur = 0, min(self.prompt_lengths)
        self.filled = cached  # tokens in the cache (below ``cur`` while a (chunked) prefill runs)
        self.checker = stop_checker(engine, admission.prompts, p)  # its stop strings (the sampling rank)

    def held(self) -> list[int]:
        """The sequences that still hold a cache row (those that have not ended)."""
        return [i for i, row in enumerate(self.rows) if row is not None]

    def live(self) -> torch.Tensor:
        """The rows whose token of this step is generated text (not a prompt token, not past their end)."""
        return (self.cur < self.ends) & (self.cur >= self.lengths)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """This step's token of every row (the sampling rank): a prompt token while a row reads its
        prompt, else a sample (-1 marks logits holding NaN or inf)."""
        cur = self.cur
        last = ban_after(logits[:, -1], self.tokens[:, cur - 1], self.params)
        return torch.where(cur < self.lengths, self.tokens[:, cur],
                           sample_or_mark(last, self.params, self.generator, self.counts, self.unprintable))

    def take(self, new: torch.Tensor, logits: torch.Tensor | None, hit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the broadcast tokens ``new`` (``hit``: the rows they end at a stop string); return
        (rows that emitted a token, rows that ended)."""
        filled, cur, p = self.filled, self.cur, self.params
        self.params = decayed_top_p(p)
        new = new.clamp(min=0)
        finished = cur >= self.ends
        self.tokens[:, cur] = torch.where(finished, self.tokens[:, cur], new)
        if logits is not None:
            self.values[:, filled:cur] = position_stats(logits, self.tokens[:, filled + 1:cur + 1], p.top_n_logprobs,
                                                             self.unprintable)
        double = torch.tensor(p.double_stop_ids, dtype=torch.long, device=new.device)
        double_stop = torch.isin(new, double) & torch.isin(self.tokens[:, cur - 1], double)
        stop_here = ~finished & (cur >= self.lengths) & (torch.isin(new, self.stops) | double_stop | hit)
        self.stopped |= stop_here
        self.ends = torch.where(stop_here, cur + 1, self.ends)
        emitted = ~finished & (cur >= self.lengths)
        if self.counts is not None:
            self.counts.scatter_add_(1, new.unsqueeze(1), emitted.unsqueeze(1).float())
        return emitted, cur + 1 >= self.ends

    def prefilled(self, logits: torch.Tensor | None, n: int) -> None:
        """A chunk of ``n`` prompt tokens (not the prefill's last) ran: keep its log-probs, sample nothing."""
        f = self.filled
        if logits is not None:
            self.values[:, f:f + n] = position_stats(logits, self.tokens[:, f + 1:f + n + 1], self.params.top_n_logprobs,
                                                     self.unprintable)
        self.filled += n

    def results(self, values: torch.Tensor) -> list[Generation]:
        tokens, ends, top_n = self.tokens.cpu(), self.ends.tolist(), self.params.top_n_logprobs
        return [generation_result(tokens[i, :ends[i]].tolist(), self.prompt_lengths[i], values[i, :ends[i] - 1], top_n,
                        "stop" if self.stopped[i] else "length") for i in range(len(self.rows))]


def every_sequence(logits: torch.Tensor, held: list[int], r: BatchRequest) -> torch.Tensor:
    """``logits`` of the sequences ``held`` of ``r``, as ``[every sequence, ...]`` (zeros for those that ended)."""
    if len(held) == len(r.rows):
        return logits
    out = logits.new_zeros(len(r.rows), *logits.shape[1:])
    out[held] = logits
    return out
