"""Speculative decoding's draft step over a batch (:mod:`.speculative`): the model's multi-token
prediction depths, each with a key/value cache of its own, one row per sequence.

The sequences of a batch stand at different lengths (each keeps its own number of drafts per verify
step), so each depth's cache (and the main model's) is a :class:`RowCache`, whose rows have lengths of
their own and whose forward passes take each row's positions and attention mask (MLA's latent cache
alike).
Depth ``k`` of row ``r`` runs over positions ``[f, n)``: ``f`` its first entry not yet final, ``n`` the
row's latest position. One forward pass per depth covers every row: a row with fewer positions to
run than the longest starts earlier, computing again entries that were final (the same tokens and
inputs: the same entries); a row whose whole text is shorter runs in a pass of its own.
"""

from __future__ import annotations

import torch

from ..parallel.comm import _all_gather
from .sampling import NonFiniteLogitsError, SamplingParams, sampling_logits


class RowCache:
    """A key/value cache of ``rows`` rows of up to ``length`` tokens, each at its own length
    (``lengths``): a forward pass over some rows (:meth:`begin`) writes each row's new tokens after its
    own, and attention reads ``[0, longest + s_new)`` of those rows under a mask that shows each query
    its row's keys up to its own position (what :class:`~.paged_cache.PagedCache` does for the
    continuous batch, here in one dense slab per layer: no blocks to gather). The slab starts as
    zeros, so the keys a row does not own (masked) are finite."""

    first_key = 0  # every key is kept

    def __init__(self, rows: int, length: int):
        self.max_rows, self.max_sequence_length = rows, length
        self.lengths = [0] * rows
        self.memory: dict[int, tuple[torch.Tensor, ...]] = {}
        self._rows: list[int] | None = None

    def begin(self, rows: list[int], s_new: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a pass of ``s_new`` tokens for each of ``rows``: their positions ``[b, s_new]`` and
        the attention mask ``[b, 1, s_new, k_len]`` (True: masked)."""
        starts = torch.tensor([self.lengths[r] for r in rows], dtype=torch.long)
        k_len = int(starts.max()) + s_new
        if k_len > self.max_sequence_length:
            raise ValueError(f"the key/value cache holds {self.max_sequence_length} tokens a row; asked for {k_len}")
        positions = starts[:, None] + torch.arange(s_new)[None, :]
        self._positions = positions.to(device)
        self._rows, self._new, self._k_len = list(rows), s_new, k_len
        self._index = torch.tensor(rows, dtype=torch.long, device=device)
        self._whole = rows == list(range(self.max_rows))  # every row, in order: the slab's views
        mask = torch.arange(k_len)[None, None, :] > positions[:, :, None]
        return self._positions, mask.unsqueeze(1).to(device)

    def append(self, layer_number: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store the new tokens' ``tensors`` (each ``[s_new, b, ...]``, rows in :meth:`begin`'s order);
        return ``[k_len, b, ...]`` of those rows."""
        if layer_number not in self.memory:
            self.memory[layer_number] = tuple(
                torch.zeros(self.max_sequence_length, self.max_rows, *t.shape[2:], dtype=t.dtype, device=t.device)
                for t in tensors)
        out = []
        for slab, new in zip(self.memory[layer_number], tensors):
            slab[self._positions.t(), self._index[None, :]] = new
            out.append(slab[:self._k_len] if self._whole else slab[:self._k_len].index_select(1, self._index))
        return tuple(out)

    def query_positions(self, s_new: int) -> torch.Tensor:
        return self._positions

    def advance(self) -> None:
        for r in self._rows:
            self.lengths[r] += self._new
        self._rows = None


def row_cache(rows: int, length: int) -> RowCache:
    """A cache of ``rows`` rows of ``length`` tokens (row ``i``: sequence ``i``)."""
    return RowCache(rows, length)


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

    def _depth_pass(self, depth: int, cache: RowCache, rows: list[int], s: int, ends: dict, context: dict):
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
