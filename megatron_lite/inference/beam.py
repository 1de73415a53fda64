"""Beam search as Megatron-LM's text-generation server does it: one prompt, ``beam_width`` beams.

The prompt is copied into ``beam_width`` rows. At every step the sampling rank adds each row's
log-probs of the next token to the row's running sum (at the first step only row 0 counts: the
rows are still equal) and ranks the ``2 x beam_width`` best (row, token) candidates (with k > 1
stop tokens ``(1 + k) x beam_width``, so that ``beam_width`` of them always continue). Walking
down that list, a candidate whose token is a stop token becomes a finished *hypothesis* when it
ranks among the first ``beam_width`` (the stop token included in its tokens and its length),
and any other candidate continues as a beam, until ``beam_width`` beams are chosen. A hypothesis
scores ``sum of the log-probs of its generated tokens / (generated length) ** length_penalty``;
at most ``beam_width`` of them are kept (the worst is dropped). The search ends when
``beam_width`` hypotheses are kept and none of them scores below the best candidate's sum
divided by the current length ``** length_penalty``, or after ``tokens_to_generate`` tokens,
when the open beams (length ``tokens_to_generate``) join the hypotheses. The answer is the kept
hypotheses, best first.

Parallel layouts: every rank runs the same steps. The sampling rank broadcasts the ranked
candidates, every rank walks the list the same way, reorders its token rows and the rows of its
part of the key/value cache by the beams' origins (:meth:`KVCache.reorder`, which covers every
cached tensor: standard attention's keys and values and MLA's latent and rotary key alike).
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache
from .sampling import NonFiniteLogitsError, ban_after


class Hypotheses:
    """The best ``width`` finished sequences so far and Megatron's rule for when the search is done."""

    def __init__(self, width: int, length_penalty: float):
        self.width, self.length_penalty = width, length_penalty
        self.kept: list[tuple[float, list[int], bool]] = []  # (score, tokens, ended at a stop token)

    def add(self, tokens: list[int], total: float, length: int, stopped: bool) -> None:
        score = total / length ** self.length_penalty
        if len(self.kept) < self.width or score > min(h[0] for h in self.kept):
            self.kept.append((score, tokens, stopped))
            if len(self.kept) > self.width:
                self.kept.remove(min(self.kept, key=lambda h: h[0]))

    def is_done(self, best_total: float, length: int) -> bool:
        """Whether no open beam can beat the worst kept hypothesis (Megatron's estimate: the best
        running sum at this length)."""
        if len(self.kept) < self.width:
            return False
        return min(h[0] for h in self.kept) >= best_total / length ** self.length_penalty

    def best(self) -> list[tuple[float, list[int], bool]]:
        return sorted(self.kept, key=lambda h: h[0], reverse=True)


def _check(engine, prompts, params, stops) -> None:
    if len(prompts) != 1:
        raise ValueError(f"beam_width: beam search continues one prompt at a time, got {len(prompts)}")
    if params.tokens_to_generate < 1:
        raise ValueError("beam_width: beam search needs tokens_to_generate >= 1")
    if params.beam_width > engine.printable_size - len(stops):
        raise ValueError(f"beam_width must be at most {engine.printable_size - len(stops)} (the vocabulary less the "
                         f"stop tokens), got {params.beam_width}")


def _candidates(engine, logits, previous, sums, params, first: bool, stops: int) -> tuple[list[int], list[float]]:
    """The ranked (row x vocab + token) candidates and their running sums, the same on every rank:
    Megatron's ``2 x width`` for one stop token, ``width x (1 + stops)`` for more, so that at least
    ``width`` of them continue (each row contributes at most ``stops`` stop-token candidates)."""
    width, vocab = params.beam_width, engine.vocab_size
    count = width * (1 + max(1, stops))
    count = min(count, vocab) if first else count
    packed = torch.zeros(1 + 2 * count, dtype=torch.float64, device=engine.device)
    if engine.is_src:
        last = logits[:, -1]
        packed[0] = float(not bool(torch.isfinite(last).all()))
        logp = torch.log_softmax(ban_after(last.nan_to_num(0.0, 0.0, 0.0), previous, params), dim=-1) + sums[:, None]
        if engine.unprintable is not None:  # never a candidate (their log-probs still count in the softmax)
            logp = logp.masked_fill(engine.unprintable, float("-inf"))
        best = (logp[0] if first else logp.reshape(-1)).topk(count)
        packed[1:1 + count], packed[1 + count:] = best.indices.double(), best.values.double()
    packed = engine._broadcast(packed).tolist()
    if packed[0]:
        raise NonFiniteLogitsError()
    return [int(i) for i in packed[1:1 + count]], packed[1 + count:]


@torch.no_grad()
def beam_search(engine, prompts: list[list[int]], params) -> list[tuple[list[int], float, bool]]:
    """``params.beam_width`` hypotheses for ``prompts[0]``, best first: ``(prompt + generated
    tokens, score, whether a stop token ended it)``. Every rank of ``engine`` must call it."""
    stops = set(params.stop_token_ids) | ({engine.eod} if params.stop_on_eod and engine.eod is not None else set())
    _check(engine, prompts, params, stops)
    width, vocab, prompt = params.beam_width, engine.vocab_size, prompts[0]
    start, end = len(prompt), len(prompt) + params.tokens_to_generate
    tokens = torch.tensor([prompt + [0] * params.tokens_to_generate] * width, dtype=torch.long, device=engine.device)
    cache = KVCache(width, end) if engine.use_cache else None
    sums = torch.zeros(width, device=engine.device)
    found = Hypotheses(width, params.length_penalty)
    done, prev = False, 0
    for cur in range(start, end):
        logits = engine.forward(tokens[:, prev:cur] if cache is not None else tokens[:, :cur], cache)
        if cache is not None:
            cache.advance(cur - prev)
        ids, totals = _candidates(engine, logits, tokens[:, cur - 1], sums, params, cur == start, len(stops))
        beams = []  # (origin row, token, running sum)
        for rank, (flat, total) in enumerate(zip(ids, totals)):
            origin, token = divmod(flat, vocab)
            if token not in stops:
                beams.append((origin, token, total))
            elif rank < width:
                found.add(tokens[origin, :cur].tolist() + [token], total, cur + 1 - start, True)
            if len(beams) == width:
                break
        done = found.is_done(totals[0], cur + 1 - start)
        origins = torch.tensor([b[0] for b in beams], dtype=torch.long, device=engine.device)
        tokens = tokens[origins]
        tokens[:, cur] = torch.tensor([b[1] for b in beams], dtype=torch.long, device=engine.device)
        sums = torch.tensor([b[2] for b in beams], dtype=torch.float32, device=engine.device)
        if done:
            break
        if cache is not None:
            cache.reorder(origins)
        prev = cur
    if not done:
        for row, total in zip(tokens.tolist(), sums.tolist()):
            found.add(row, total, end - start, False)
    return [(t, score, stopped) for score, t, stopped in found.best()]
