"""The paged key/value cache of continuous batching: a pool of fixed-size blocks, a block table per row.

:class:`~megatron_lite.inference.kv_cache.KVCache` holds one static batch whose sequences all have
the same length. Here each of ``max_rows`` rows belongs to one sequence of one request while it
decodes, at its own length (``lengths``). A row's tokens live in blocks of ``block_size`` tokens
taken from one pool of ``num_blocks`` (``--inference-dynamic-batching-block-size``,
``--inference-kv-cache-blocks``): its block table (``tables[row]``) lists them in order, token ``p``
sits in slot ``p % block_size`` of block ``tables[row][p // block_size]``, and a block is taken
from the pool only when the row's next tokens need it (:meth:`begin`). So the memory counts
blocks, not rows times the model's context: many short sequences fit where a slab per row could
not.

Admission reserves blocks: :meth:`allocate` takes ``n`` rows that may each grow to ``max_tokens``
tokens and promises them the blocks that needs (:meth:`blocks_for`), so a sequence never finds
the pool empty half-way (no preemption, no wrong answer); :meth:`fits` says whether the pool
(free blocks minus those promised) and the free rows can take a request now, and a request that
does not fit waits. :meth:`release` returns a row's blocks and its promise to the pool.

Block 0 is never handed out: it stays zero, and every key position a row does not own (past its
length, up to the longest row of the forward pass) reads from it, so a stale block of a finished
request (even one holding NaN) never reaches another row's attention.

A forward pass covers any set of rows (:meth:`begin`): the new tokens of row ``r`` go to its
positions ``[lengths[r], lengths[r] + s_new)`` - every layer's :meth:`append` writes them into
their slots and returns every cached entry of those rows, ``[max length + s_new, b, ...]``
(gathered through the block tables, computed once per pass for all layers) - and :meth:`begin`
returns the positions of the new tokens (for the position embedding or RoPE) and the attention
mask (True = masked) under which query ``i`` of row ``r`` sees exactly that row's keys ``<=
lengths[r] + i``. The layers (standard attention and MLA's latent cache alike) take this object
as their ``inference_context`` with no change: they only call :meth:`append` (and a sliding-window
layer :meth:`query_positions`, each row's own, to mask the keys before its window).

Sliding windows (``reach``: :func:`~megatron_lite.models.window_config.cache_reach`, set when every
layer has a window of at most ``reach`` keys before its query): no later query of a row looks more
than ``reach`` positions back, so :meth:`begin` first returns to the pool the blocks wholly before
``lengths[r] - reach`` (their table entries become 0, the zero block, which the window masks in every
layer) and a pass reads the keys from ``first_key`` on, the earliest position a row of the pass still
holds. A row then holds at most :meth:`row_blocks` blocks at once - those of its prefill, or of
``reach + 1`` keys while it decodes - and admission promises it only that. A model with a
full-attention layer (``--window-attn-skip-freq``) keeps every block: the pool is shared by all
layers, so a block is returned only when no layer reads it.
"""

from __future__ import annotations

import torch


class PagedCache:
    def __init__(self, max_rows: int, max_sequence_length: int, block_size: int = 16, num_blocks: int | None = None,
                 reach: int | None = None):
        if max_rows < 1 or max_sequence_length < 1 or block_size < 1:
            raise ValueError(f"a paged key/value cache needs a positive number of rows, length and block size, got "
                             f"{max_rows} x {max_sequence_length}, blocks of {block_size}")
        self.max_rows, self.max_sequence_length, self.block_size = max_rows, max_sequence_length, block_size
        self.reach = reach  # every layer's window looks at most this far back (None: keep every block)
        self.first_key = 0  # the position of the first key a pass reads (keys before it were returned)
        self.num_blocks = num_blocks if num_blocks is not None else max_rows * self.blocks_for(max_sequence_length)
        if self.num_blocks < 1:
            raise ValueError(f"a paged key/value cache needs at least one block, got {self.num_blocks}")
        self.lengths = [0] * max_rows
        self.free = list(range(max_rows))
        self.free_blocks = list(range(1, self.num_blocks + 1))  # block 0: the zero block
        self.tables: list[list[int]] = [[] for _ in range(max_rows)]
        self.reserved = [0] * max_rows  # blocks promised to each row in use (its table included)
        self.memory: dict[int, tuple[torch.Tensor, ...]] = {}
        self._rows: list[int] | None = None

    # -- rows and blocks -------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens of one row."""
        return -(-tokens // self.block_size)

    def row_blocks(self, max_tokens: int, prefill: int | None = None) -> int:
        """The most blocks one row holds at once: a row of up to ``max_tokens`` tokens whose longest
        forward pass feeds ``prefill`` tokens (its prefill; None: ``max_tokens``). All its blocks
        without a window; with one, a pass at position ``a`` of ``n`` tokens holds the positions
        ``[a - reach, a + n)``: at most ``max(prefill, reach + 1)`` tokens, at any block offset."""
        whole = self.blocks_for(max_tokens)
        if self.reach is None:
            return whole
        span = max(max_tokens if prefill is None else prefill, self.reach + 1)
        return min(whole, (span + 2 * self.block_size - 2) // self.block_size)

    def _dropped(self, length: int) -> int:
        """Leading blocks of a row at ``length`` that its next queries can no longer see."""
        return 0 if self.reach is None else max(0, length - self.reach) // self.block_size

    def _held(self, row: int) -> int:
        return sum(1 for block in self.tables[row] if block)

    @property
    def promised(self) -> int:
        """Blocks reserved by rows in use and not yet taken from the pool."""
        return sum(self.reserved[r] - self._held(r) for r in range(self.max_rows) if r not in self.free)

    @property
    def available(self) -> int:
        """Blocks a new request may reserve now."""
        return len(self.free_blocks) - self.promised

    def fits(self, n: int, max_tokens: int, prefill: int | None = None) -> bool:
        """Whether ``n`` rows of up to ``max_tokens`` tokens each can be allocated now."""
        return n <= len(self.free) and n * self.row_blocks(max_tokens, prefill) <= self.available

    def allocate(self, n: int, max_tokens: int, prefill: int | None = None) -> list[int]:
        """``n`` free rows (the lowest numbers first), now in use at length 0, each promised the blocks
        it holds at once (:meth:`row_blocks`); ValueError without room."""
        if n > len(self.free):
            raise ValueError(f"the key/value cache has {len(self.free)} free rows of {self.max_rows}; asked for {n}")
        if max_tokens > self.max_sequence_length:
            raise ValueError(f"a row of the key/value cache holds {self.max_sequence_length} tokens; asked for {max_tokens}")
        need = n * self.row_blocks(max_tokens, prefill)
        if need > self.available:
            raise ValueError(f"the key/value cache has {self.available} blocks free of {self.num_blocks}; asked for {need}")
        rows, self.free = self.free[:n], self.free[n:]
        for r in rows:
            self.reserved[r] = self.row_blocks(max_tokens, prefill)
        return rows

    def release(self, rows: list[int]) -> None:
        """Free ``rows`` and return their blocks to the pool (their cached tokens are forgotten)."""
        for r in rows:
            if r in self.free or not 0 <= r < self.max_rows:
                raise ValueError(f"row {r} of the key/value cache is not in use")
            self.free_blocks += [block for block in self.tables[r] if block]
            self.tables[r], self.reserved[r], self.lengths[r] = [], 0, 0
        self.free = sorted(self.free + list(rows))

    # -- one forward pass ------------------------------------------------------------------------
    def begin(self, rows: list[int], s_new: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a forward pass of ``s_new`` new tokens for each of ``rows`` (in that batch order),
        taking the blocks they need (and returning those beyond every window); return their positions
        ``[b, s_new]`` and the attention mask ``[b, 1, s_new, k_len - first_key]``."""
        for r in rows:
            if r in self.free:
                raise ValueError(f"row {r} of the key/value cache is not in use")
            end = self.lengths[r] + s_new
            if self.blocks_for(end) - self._dropped(self.lengths[r]) > self.reserved[r]:
                raise ValueError(f"row {r} of the key/value cache holds {self.reserved[r]} blocks of "
                                 f"{self.block_size} tokens; asked for positions {self.lengths[r]}..{end - 1}")
        for r in rows:
            table = self.tables[r]
            for i in range(self._dropped(self.lengths[r])):  # beyond every window from now on
                if table[i]:
                    self.free_blocks.append(table[i])
                    table[i] = 0
            while len(table) * self.block_size < self.lengths[r] + s_new:
                table.append(self.free_blocks.pop(0))
        first = self.first_key = min(self._dropped(self.lengths[r]) for r in rows) * self.block_size
        starts = torch.tensor([self.lengths[r] for r in rows], dtype=torch.long)
        k_len = int(starts.max()) + s_new
        positions = starts[:, None] + torch.arange(s_new)[None, :]  # [b, s_new]
        keys = torch.arange(first, k_len)
        width = max(len(self.tables[r]) for r in rows)
        tables = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in rows], dtype=torch.long)
        slots = tables.gather(1, (keys // self.block_size)[None, :].clamp(max=width - 1).expand(len(rows), -1))
        slots = slots * self.block_size + keys % self.block_size  # [b, k_len - first]
        owned = keys[None, :] < (starts + s_new)[:, None]
        self._read = torch.where(owned, slots, 0).t().reshape(-1).to(device)  # [(k_len - first) * b], key-major
        self._write = slots.gather(1, positions - first).t().reshape(-1).to(device)  # [s_new * b]
        self._rows, self._new, self._k_len = list(rows), s_new, k_len - first
        self._positions = positions
        mask = keys[None, None, :] > positions[:, :, None]  # [b, s_new, k_len - first]
        return positions.to(device), mask.unsqueeze(1).to(device)

    def append(self, layer_number: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store the new tokens' ``tensors`` (each ``[s_new, b, ...]``, rows in :meth:`begin`'s order)
        of layer ``layer_number``; return the cached entries of those rows from ``first_key`` on,
        ``[k_len - first_key, b, ...]``."""
        if self._rows is None:
            raise RuntimeError("PagedCache.append before begin()")
        s_new, b = tensors[0].shape[:2]
        if s_new != self._new or b != len(self._rows):
            raise ValueError(f"begin() prepared {len(self._rows)} rows x {self._new} tokens; "
                             f"layer {layer_number} appends {b} x {s_new}")
        if layer_number not in self.memory:  # zeros: the zero block must hold finite values
            slots = (self.num_blocks + 1) * self.block_size
            self.memory[layer_number] = tuple(torch.zeros(slots, *t.shape[2:], dtype=t.dtype, device=t.device)
                                              for t in tensors)
        stored = self.memory[layer_number]
        if len(stored) != len(tensors):
            raise ValueError(f"layer {layer_number} cached {len(stored)} tensors, now appends {len(tensors)}")
        out = []
        for pool, new in zip(stored, tensors):
            pool.index_copy_(0, self._write, new.reshape(s_new * b, *new.shape[2:]))
            out.append(pool.index_select(0, self._read).view(self._k_len, b, *new.shape[2:]))
        return tuple(out)

    def query_positions(self, s_new: int) -> torch.Tensor:
        """Positions ``[b, s_new]`` of the pass's new tokens in their rows (sliding-window attention's mask)."""
        return self._positions

    def advance(self) -> None:
        """Count the forward pass's new tokens as cached, in each of its rows."""
        for r in self._rows:
            self.lengths[r] += self._new
        self._rows = None
