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

Prefix caching (``prefix_caching``, ``--enable-prefix-caching``): a full block is named by the chain
hash of every token up to its end (:func:`chain_hashes`) once the keys of all its positions are
written - prompt blocks and, from the tokens fed to the row (``tokens`` of :meth:`begin`, which every
rank has), the blocks its generated tokens fill. A row's last sampled token is written only when it is
fed back, so the block holding it is named a step later (or never, if the row ends there). A chat's
next turn, whose prompt is the last prompt, its answer and a new message, so finds the answer's full
blocks too. Each block counts the rows whose tables hold it (``refs``). A row given its prompt at
:meth:`allocate` starts after the longest run of its leading blocks found there (all the rows of a
request at the same length, at most ``reuse_limit`` tokens, so at least one prompt token is always
computed), holding those blocks instead of computing them; rows of one request with equal leading
prompt blocks hold one copy of each (the first such row writes it, the others read it). A block
whose count falls to 0 goes back to the pool still named (least recently freed first in line), so a
later prompt can still find it until the pool hands it out again (eviction). The promise counts
only the blocks a row will take from the pool itself (``owed``), so shared blocks are not counted
twice and no row ever finds the pool empty.

Sliding windows (``reach``: :func:`~megatron_lite.models.window_config.cache_reach`, set when every
layer has a window of at most ``reach`` keys before its query): no later query of a row looks more
than ``reach`` positions back, so :meth:`begin` first drops the row's blocks wholly before
``lengths[r] - reach`` (their table entries become 0, the zero block, which the window masks in every
layer) and a pass reads the keys from ``first_key`` on, the earliest position a row of the pass still
holds. A dropped block loses that row's reference only: it goes back to the pool (still named, if
it is) when no other row holds it. A row then holds at most :meth:`row_blocks` blocks at once - those
of its prefill, or of ``reach + 1`` keys while it decodes - and is promised exactly that, shared
blocks included: a block shared with another row leaves this row's window while the other still
holds it, so it cannot be counted as the other row's alone. The pool keeps the sum of the rows'
promises (each row's window cap) within its blocks, so a row never finds it empty. With prefix
caching a windowed row still starts after its cached prefix (the prefill it saves), but holds only
the cached blocks its window reaches. A model with a full-attention layer
(``--window-attn-skip-freq``) keeps every block: the pool is shared by all layers, so a block is
returned only when no layer reads it.
"""

from __future__ import annotations

import hashlib

import torch


def chain_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The name of each full block of ``tokens``: a hash of every token up to the block's end (the
    block's tokens and the previous block's name)."""
    out, name = [], b""
    for end in range(block_size, len(tokens) + 1, block_size):
        name = block_name(name, tokens[end - block_size:end])
        out.append(name)
    return out


def block_name(previous: bytes, block: list[int]) -> bytes:
    """The name of a block holding the tokens ``block`` after the block named ``previous`` (b"": the first)."""
    return hashlib.sha256(previous + b",".join(str(t).encode() for t in block)).digest()


class PagedCache:
    def __init__(self, max_rows: int, max_sequence_length: int, block_size: int = 16, num_blocks: int | None = None,
                 prefix_caching: bool = False, reach: int | None = None):
        if max_rows < 1 or max_sequence_length < 1 or block_size < 1:
            raise ValueError(f"a paged key/value cache needs a positive number of rows, length and block size, got "
                             f"{max_rows} x {max_sequence_length}, blocks of {block_size}")
        self.max_rows, self.max_sequence_length, self.block_size = max_rows, max_sequence_length, block_size
        self.reach = reach  # every layer's window looks at most this far back (None: keep every block)
        self.first_key = 0  # the position of the first key a pass reads (keys before it were dropped)
        self.num_blocks = num_blocks if num_blocks is not None else max_rows * self.blocks_for(max_sequence_length)
        if self.num_blocks < 1:
            raise ValueError(f"a paged key/value cache needs at least one block, got {self.num_blocks}")
        self.prefix_caching = prefix_caching
        self.lengths = [0] * max_rows
        self.free = list(range(max_rows))
        self.free_blocks = list(range(1, self.num_blocks + 1))  # block 0: the zero block
        self.tables: list[list[int]] = [[] for _ in range(max_rows)]
        self.reserved = [0] * max_rows  # blocks each row in use may hold (its table included)
        self.owed = [0] * max_rows  # blocks promised to each row in use, not yet taken from the pool (no window)
        self.refs = [0] * (self.num_blocks + 1)  # rows holding each block
        self.hashes: list[list[bytes]] = [[] for _ in range(max_rows)]  # names of each row's full blocks known so far
        self.written: list[list[int] | None] = [None] * max_rows  # each row's tokens in the cache (None: unknown)
        self.named = [0] * max_rows  # each row's blocks looked at for naming so far
        self.shared: list[dict[int, int]] = [{} for _ in range(max_rows)]  # block index -> row that writes it
        self.cached: dict[bytes, int] = {}  # name -> block holding it
        self.names: dict[int, bytes] = {}  # block -> its name
        self.reused_tokens = self.evicted_blocks = 0  # prefill tokens not computed, named blocks handed out again
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

    @property
    def promised(self) -> int:
        """Blocks promised to rows in use and not yet taken from the pool. With a window: the rows'
        caps less the blocks out of the pool (each held by at least one of them)."""
        if self.reach is None:
            return sum(self.owed)
        return sum(self.reserved) - (self.num_blocks - len(self.free_blocks))

    @property
    def available(self) -> int:
        """Blocks a new request may reserve now."""
        return len(self.free_blocks) - self.promised

    def _layout(self, n: int, prompts: list[list[int]] | None, reuse_limit: int):
        """For ``n`` rows of ``prompts`` (None: no prefix caching): the names of each row's full prompt
        blocks, the number of leading blocks every row finds cached (at most ``reuse_limit`` tokens),
        and per row the later blocks it shares with an earlier row of the request ({index: that row's
        position among the n})."""
        if not self.prefix_caching or prompts is None:
            return [[] for _ in range(n)], 0, [{} for _ in range(n)]
        hashes = [chain_hashes(p, self.block_size) for p in prompts]
        found = min(next((j for j, h in enumerate(names) if h not in self.cached), len(names)) for names in hashes)
        k, first, shared = min(found, max(reuse_limit, 0) // self.block_size), {}, []
        for i, names in enumerate(hashes):
            shared.append({j: first.setdefault(names[j], i) for j in range(k, len(names))})
            shared[-1] = {j: w for j, w in shared[-1].items() if w != i}
        return hashes, k, shared

    def cost(self, n: int, max_tokens: int, prompts: list[list[int]] | None = None, reuse_limit: int = 0, *,
             prefill: int | None = None) -> int:
        """Blocks :meth:`allocate` takes from what is :attr:`available` for these rows now (with a
        window: each row's cap, :meth:`row_blocks` of its prefill, the shortest prompt)."""
        if self.reach is not None:
            return n * self.row_blocks(max_tokens, _prefill(prompts, prefill))
        hashes, k, shared = self._layout(n, prompts, reuse_limit)
        found = {self.cached[names[j]] for names in hashes for j in range(k)}
        return n * (self.blocks_for(max_tokens) - k) - sum(len(s) for s in shared) + sum(self.refs[b] == 0 for b in found)

    def fits(self, n: int, max_tokens: int, prompts: list[list[int]] | None = None, reuse_limit: int = 0, *,
             prefill: int | None = None) -> bool:
        """Whether ``n`` rows of up to ``max_tokens`` tokens each can be allocated now."""
        return n <= len(self.free) and self.cost(n, max_tokens, prompts, reuse_limit, prefill=prefill) <= self.available

    def allocate(self, n: int, max_tokens: int, prompts: list[list[int]] | None = None, reuse_limit: int = 0, *,
                 prefill: int | None = None) -> list[int]:
        """``n`` free rows (the lowest numbers first), now in use, each promised the blocks of
        ``max_tokens`` tokens it holds at once (:meth:`row_blocks`); ValueError without room. With
        ``prompts`` (one per row) and prefix caching the rows start at the length of the prompt
        blocks found cached (else 0), holding those of them their windows reach. ``prefill``: the
        longest pass of a row (None: the shortest prompt, else ``max_tokens``)."""
        if n > len(self.free):
            raise ValueError(f"the key/value cache has {len(self.free)} free rows of {self.max_rows}; asked for {n}")
        if max_tokens > self.max_sequence_length:
            raise ValueError(f"a row of the key/value cache holds {self.max_sequence_length} tokens; asked for {max_tokens}")
        need = self.cost(n, max_tokens, prompts, reuse_limit, prefill=prefill)
        if need > self.available:
            raise ValueError(f"the key/value cache has {self.available} blocks free of {self.num_blocks}; asked for {need}")
        hashes, k, shared = self._layout(n, prompts, reuse_limit)
        rows, self.free = self.free[:n], self.free[n:]
        for r, names, share, prompt in zip(rows, hashes, shared, prompts or [None] * n):
            drop = self._dropped(k * self.block_size)  # beyond the window: not held
            self.tables[r] = [0] * drop + [self.cached[h] for h in names[drop:k]]
            for b in self.tables[r][drop:]:
                if self.refs[b] == 0:
                    self.free_blocks.remove(b)
                self.refs[b] += 1
            self.lengths[r], self.hashes[r], self.named[r] = k * self.block_size, names, k
            self.written[r] = list(prompt[:k * self.block_size]) if self.prefix_caching and prompt else None
            self.shared[r] = {j: rows[w] for j, w in share.items()}
            self.reserved[r] = self.row_blocks(max_tokens, _prefill(prompts, prefill))
            self.owed[r] = self.reserved[r] - k - len(share) if self.reach is None else 0
        self.reused_tokens += n * k * self.block_size
        return rows

    def release(self, rows: list[int]) -> None:
        """Free ``rows``; the blocks no other row holds go back to the pool (a named one stays cached
        until the pool hands it out again, an unnamed one is handed out first)."""
        for r in rows:
            if r in self.free or not 0 <= r < self.max_rows:
                raise ValueError(f"row {r} of the key/value cache is not in use")
            for b in reversed(self.tables[r]) if self.prefix_caching else self.tables[r]:
                self._unref(b)
            self.tables[r], self.reserved[r], self.owed[r], self.lengths[r] = [], 0, 0, 0
            self.hashes[r], self.shared[r], self.named[r], self.written[r] = [], {}, 0, None
        self.free = sorted(self.free + list(rows))

    def _unref(self, b: int) -> None:
        """A row stops holding block ``b`` (0: none); held by no row, it goes back to the pool."""
        if not b:
            return
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if self.prefix_caching and b not in self.names:
                self.free_blocks.insert(0, b)
            else:
                self.free_blocks.append(b)

    def _take(self) -> int:
        """A block from the pool (the least recently freed; a named one forgets its name: evicted)."""
        b = self.free_blocks.pop(0)
        if b in self.names:
            del self.cached[self.names.pop(b)]
            self.evicted_blocks += 1
        return b

    def _name_blocks(self, r: int) -> None:
        """Name row ``r``'s full blocks written so far (first come: a name keeps its block): its prompt's
        by their names from :meth:`allocate`, the later ones by the tokens fed to the row (generated)."""
        size, names, written = self.block_size, self.hashes[r], self.written[r]
        while written is not None and len(names) < self.lengths[r] // size:
            j = len(names)
            names.append(block_name(names[-1] if names else b"", written[j * size:(j + 1) * size]))
        done = min(self.lengths[r] // size, len(names))
        for j in range(self.named[r], done):
            h, b = self.hashes[r][j], self.tables[r][j]
            if b and h not in self.cached and b not in self.names:
                self.cached[h], self.names[b] = b, h
        self.named[r] = max(self.named[r], done)

    # -- one forward pass ------------------------------------------------------------------------
    def begin(self, rows: list[int], s_new: int, device, tokens: list[list[int]] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a forward pass of ``s_new`` new tokens for each of ``rows`` (in that batch order),
        taking the blocks they need (and dropping those beyond every window); return their positions
        ``[b, s_new]`` and the attention mask ``[b, 1, s_new, k_len - first_key]``. ``tokens``: the
        ids fed to each row (prefix caching names the blocks they fill; None: only prompt blocks)."""
        for r in rows:
            if r in self.free:
                raise ValueError(f"row {r} of the key/value cache is not in use")
            end = self.lengths[r] + s_new
            if self.blocks_for(end) - self._dropped(self.lengths[r]) > self.reserved[r]:
                raise ValueError(f"row {r} of the key/value cache holds {self.reserved[r]} blocks of "
                                 f"{self.block_size} tokens; asked for positions {self.lengths[r]}..{end - 1}")
        for r in rows:  # beyond every window from now on: this row's reference goes
            table = self.tables[r]
            for i in range(self._dropped(self.lengths[r])):
                self._unref(table[i])
                table[i] = 0
        for r in rows:  # a row sharing a block with an earlier row of its request comes after it
            while len(self.tables[r]) * self.block_size < self.lengths[r] + s_new:
                j = len(self.tables[r])
                if j in self.shared[r]:
                    b = self.tables[self.shared[r][j]][j]
                else:
                    b = self._take()
                    self.owed[r] -= self.reach is None
                self.refs[b] += 1
                self.tables[r].append(b)
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
        write = slots.gather(1, positions - first).t().reshape(-1)  # [s_new * b]
        self._keep = None  # rows sharing a block being written: only the first one writes it
        if self.prefix_caching:
            unique, inverse = torch.unique(write, return_inverse=True)
            if len(unique) < len(write):
                order = torch.arange(len(write))
                self._keep = torch.full((len(unique),), len(write)).scatter_reduce(0, inverse, order, "amin").to(device)
        self._write = write.to(device) if self._keep is None else write.to(device)[self._keep]
        self._rows, self._new, self._k_len, self._fed = list(rows), s_new, k_len - first, tokens
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
            flat = new.reshape(s_new * b, *new.shape[2:])
            pool.index_copy_(0, self._write, flat if self._keep is None else flat[self._keep])
            out.append(pool.index_select(0, self._read).view(self._k_len, b, *new.shape[2:]))
        return tuple(out)

    def query_positions(self, s_new: int) -> torch.Tensor:
        """Positions ``[b, s_new]`` of the pass's new tokens in their rows (sliding-window attention's mask)."""
        return self._positions

    def advance(self) -> None:
        """Count the forward pass's new tokens as cached, in each of its rows."""
        for i, r in enumerate(self._rows):
            if self.written[r] is not None:  # the tokens of every position up to the row's end, or unknown
                if self._fed is not None and len(self.written[r]) == self.lengths[r]:
                    self.written[r].extend(self._fed[i])
                else:
                    self.written[r] = None
            self.lengths[r] += self._new
            if self.hashes[r] or self.written[r] is not None:
                self._name_blocks(r)
        self._rows = None


def _prefill(prompts: list[list[int]] | None, prefill: int | None) -> int | None:
    """The most tokens one forward pass of a request feeds a row: ``prefill`` if given, else the
    shortest prompt (the longer prompts' other tokens go one a step, as the generated ones)."""
    return prefill if prefill is not None or prompts is None else min(len(p) for p in prompts)
