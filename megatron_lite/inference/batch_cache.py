"""The key/value cache of continuous batching: a fixed number of rows, each at its own length.

:class:`~megatron_lite.inference.kv_cache.KVCache` holds one batch whose sequences all have the
same length. Here each of ``max_rows`` rows belongs to one sequence of one request while it decodes
(:meth:`BatchCache.allocate`), keeps its own count of cached tokens (``lengths``), and is freed
for the next request when its request ends (:meth:`BatchCache.release`); a freed row's length is
0 again, and the stale keys it still holds are never attended to (they lie past its length).

A forward pass covers any set of rows (:meth:`begin`): the new tokens of row ``r`` go to its
positions ``[lengths[r], lengths[r] + s_new)`` - every layer's :meth:`append` writes them there
and returns every cached entry of those rows, ``[max length + s_new, b, ...]`` - and
:meth:`begin` returns the positions of the new tokens (for the position embedding or RoPE) and the
attention mask (True = masked) under which query ``i`` of row ``r`` sees exactly that row's keys
``<= lengths[r] + i``. The layers (standard attention and MLA's latent cache alike) take this
object as their ``inference_context`` with no change: they only call :meth:`append`.
"""

from __future__ import annotations

import torch


class BatchCache:
    def __init__(self, max_rows: int, max_sequence_length: int):
        if max_rows < 1 or max_sequence_length < 1:
            raise ValueError(f"a key/value cache needs a positive number of rows and length, got "
                             f"{max_rows} x {max_sequence_length}")
        self.max_rows, self.max_sequence_length = max_rows, max_sequence_length
        self.lengths = [0] * max_rows
        self.free = list(range(max_rows))
        self.memory: dict[int, tuple[torch.Tensor, ...]] = {}
        self._rows = self._starts = None
        self._new = 0

    # -- row bookkeeping -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` free rows (the lowest numbers first), now in use at length 0; ValueError without room."""
        if n > len(self.free):
            raise ValueError(f"the key/value cache has {len(self.free)} free rows of {self.max_rows}; asked for {n}")
        rows, self.free = self.free[:n], self.free[n:]
        return rows

    def release(self, rows: list[int]) -> None:
        """Free ``rows`` for the next request (their cached tokens are forgotten)."""
        for r in rows:
            if r in self.free or not 0 <= r < self.max_rows:
                raise ValueError(f"row {r} of the key/value cache is not in use")
            self.lengths[r] = 0
        self.free = sorted(self.free + list(rows))

    # -- one forward pass ------------------------------------------------------------------------
    def begin(self, rows: list[int], s_new: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a forward pass of ``s_new`` new tokens for each of ``rows`` (in that batch order);
        return their positions ``[b, s_new]`` and the attention mask ``[b, 1, s_new, k_len]``."""
        for r in rows:
            if r in self.free:
                raise ValueError(f"row {r} of the key/value cache is not in use")
            if self.lengths[r] + s_new > self.max_sequence_length:
                raise ValueError(f"row {r} of the key/value cache holds {self.max_sequence_length} tokens; "
                                 f"asked for {self.lengths[r] + s_new}")
        self._rows = torch.tensor(rows, dtype=torch.long, device=device)
        self._starts = torch.tensor([self.lengths[r] for r in rows], dtype=torch.long, device=device)
        self._new, self._row_list = s_new, list(rows)
        positions = self._starts[:, None] + torch.arange(s_new, device=device)[None, :]  # [b, s_new]
        k_len = max(self.lengths[r] for r in rows) + s_new
        mask = torch.arange(k_len, device=device)[None, None, :] > positions[:, :, None]  # [b, s_new, k_len]
        return positions, mask.unsqueeze(1)

    def append(self, layer_number: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store the new tokens' ``tensors`` (each ``[s_new, b, ...]``, rows in :meth:`begin`'s order)
        of layer ``layer_number``; return every cached entry of those rows, ``[k_len, b, ...]``."""
        if self._rows is None:
            raise RuntimeError("BatchCache.append before begin()")
        s_new, b = tensors[0].shape[:2]
        if s_new != self._new or b != len(self._row_list):
            raise ValueError(f"begin() prepared {len(self._row_list)} rows x {self._new} tokens; "
                             f"layer {layer_number} appends {b} x {s_new}")
        if layer_number not in self.memory:  # zeros, not empty: a masked stale entry must stay finite
            self.memory[layer_number] = tuple(
                torch.zeros(self.max_sequence_length, self.max_rows, *t.shape[2:], dtype=t.dtype, device=t.device)
                for t in tensors)
        stored = self.memory[layer_number]
        if len(stored) != len(tensors):
            raise ValueError(f"layer {layer_number} cached {len(stored)} tensors, now appends {len(tensors)}")
        positions = self._starts[None, :] + torch.arange(s_new, device=self._rows.device)[:, None]  # [s_new, b]
        rows = self._rows[None, :].expand(s_new, -1)
        k_len = max(self.lengths[r] for r in self._row_list) + s_new
        out = []
        for cache, new in zip(stored, tensors):
            cache[positions, rows] = new
            out.append(cache[:k_len].index_select(1, self._rows))
        return tuple(out)

    def advance(self) -> None:
        """Count the forward pass's new tokens as cached, in each of its rows."""
        for r in self._row_list:
            self.lengths[r] += self._new
        self._rows = self._starts = None
