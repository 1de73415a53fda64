"""Speculative decoding's draft step over a batch (:mod:`.speculative`): the model's multi-token
prediction depths, each with a key/value cache of its own, one row per sequence.

The sequences of a batch stand at different lengths (each keeps its own number of drafts per verify
step), so each depth's cache is a :class:`~.paged_cache.PagedCache`, whose rows have lengths of their
own and whose forward passes take each row's positions and attention mask (MLA's latent cache alike).
Depth ``k`` of row ``r`` runs over positions ``[f, n)``: ``f`` its first entry not yet final, ``n`` the
row's latest position. One forward pass per depth covers every row: a row with fewer positions to
run than the longest starts earlier, computing again entries that were final (the same tokens and
inputs: the same entries); a row whose whole text is shorter runs in a pass of its own.
"""

from __future__ import annotations

import torch

from ..parallel.comm import _all_gather
from .paged_cache import PagedCache
from .sampling import NonFiniteLogitsError, SamplingParams, sampling_logits


def row_cache(rows: int, length: int) -> PagedCache:
    """A cache of ``rows`` rows of ``length`` tokens, every row in use (row ``i``: sequence ``i``)."""
    cache = PagedCache(rows, length, block_size=16)
    cache.allocate(rows, length)
    return cache


class MTPDrafter:
    """The draft step: the model's multi-token prediction depths, each with its own key/value cache
    and the outputs it computed kept by position and row (see the module docstring)."""

    def __init__(self, engine, depths: int, length: int, params: SamplingParams, rows: int = 1):
        self.model, self.params, self.engine = engine.model, params, engine
        self.caches = [row_cache(rows, length) for _ in range(depths)]
        h = engine.hidden_size
        self.outputs = [torch.zeros(length, rows, h, dtype=engine.dtype, device=engine.device)
                        for _ in range(depths + 1)]
        self.frontiers: list[list[int]] = []  # [depth - 1][row]: the first entry not final before the draft

    def record_main(self, row: int, start: int, hidden: torch.Tensor) -> None:
        """The main model's outputs ``[s, h]`` of row ``row`` at positions ``[start, start + s)``."""
        self.outputs[0][start:start + hidden.shape[0], row] = hidden

    def draft(self, contexts: dict[int, list[int]], count: int) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """``count`` drafts after each row's tokens ``contexts[row]`` (``t(0) .. t(n)``) and their
        distributions ``[count, V]`` (None when greedy), by row."""
        rows = sorted(contexts)
        ends = {r: len(contexts[r]) - 1 for r in rows}
        context = {r: list(contexts[r]) for r in rows}
        probs: dict[int, list] = {r: [] for r in rows}
        self.frontiers = [list(cache.lengths) for cache in self.caches[:count]]
        for depth in range(1, count + 1):
            cache = self.caches[depth - 1]
            width = max(ends[r] - cache.lengths[r] for r in rows)
            groups: dict[int, list[int]] = {}
            for r in rows:  # a row runs its last min(width, n) positions
                groups.setdefault(min(width, ends[r]), []).append(r)
            for s, group in groups.items():
                logits = self._depth_pass(depth, cache, group, s, ends, context)
                for j, r in enumerate(group):
                    token, q = self.pick(logits[j:j + 1], depth, context[r])
                    context[r].append(token)
                    probs[r].append(q)
        return {r: (context[r][ends[r] + 1:], torch.cat(probs[r]) if probs[r] and probs[r][0] is not None else None)
                for r in rows}

    def _depth_pass(self, depth: int, cache: PagedCache, rows: list[int], s: int, ends: dict, context: dict):
        """Depth ``depth`` over the last ``s`` positions of each of ``rows``: its logits ``[rows, V]`` at
        each row's last position (fp32, every rank's alike), its outputs kept."""
        engine = self.engine
        for r in rows:
            cache.lengths[r] = ends[r] - s
        ids = torch.tensor([context[r][ends[r] - s + depth:ends[r] + depth] for r in rows], device=engine.device)
        hidden = torch.stack([self.outputs[depth - 1][ends[r] - s:ends[r], r] for r in rows], dim=1)  # [s, b, h]
        positions, mask = cache.begin(rows, s, engine.device)
        logits, out = self.model.mtp_decode(depth, hidden, ids, cache, position_ids=positions, attention_mask=mask)
        cache.advance()
        for j, r in enumerate(rows):
            self.outputs[depth][ends[r] - s:ends[r], r] = out[:, j]
        logits = _all_gather(logits, -1, engine.state.tp_group)  # every rank drafts alike
        return logits[:, -1, :engine.vocab_size].float()

    def pick(self, logits: torch.Tensor, depth: int, context: list[int]) -> tuple[int, torch.Tensor | None]:
        """Depth ``depth``'s draft from its ``logits [1, V]`` (``context``: the tokens it follows):
        the argmax when greedy, else a draw from its sampling distribution ``q [1, V]``, returned with it."""
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogitsError()
        target = sampling_logits(logits, self.params, None, self.engine.unprintable)
        if self.params.top_k == 1:
            return int(target.argmax()), None
        q = target.softmax(dim=-1)
        return int(torch.multinomial(q, 1, generator=self.engine.generator)), q

    def commit(self, row: int, n: int, kept: int) -> None:
        """After row ``row``'s round at ``n`` kept ``kept`` drafts: depth ``k``'s entries up to position
        ``n + kept - k`` read accepted tokens only; forget the rest."""
        for k, frontiers in enumerate(self.frontiers, start=1):
            self.caches[k - 1].lengths[row] = max(frontiers[row], min(n, n + kept - k + 1))
