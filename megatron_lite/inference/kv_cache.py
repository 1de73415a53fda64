"""The key/value cache: what attention keeps of the tokens already seen, so decoding one more token
costs one token's work instead of the whole prefix's.

An attention module that receives ``inference_context`` (a :class:`KVCache`) stores the tensors it
needs from the new tokens - standard attention its keys and values ``[s_new, b, kv_heads, d]`` (the
key/value heads only, so grouped-query attention caches fewer heads); multi-latent attention its
compressed latent and its shared rotary key - by calling :meth:`KVCache.append` with its global
layer number, and attends over the full tensors it gets back. The memory of each layer is
allocated at the first call, for ``max_batch_size`` x ``max_sequence_length`` tokens, with each
tensor's own trailing shape and dtype.

``sequence_offset`` is the number of tokens already cached, i.e. the position of the first new
token; the engine advances it after every forward pass (:meth:`advance`), once for all layers.
Beam search copies rows between sequences with :meth:`reorder`, every cached tensor alike;
:meth:`truncate` forgets the last entries (they are overwritten next; speculative decoding cuts
each row of its paged cache back instead, :mod:`.speculative`).
With a cache, core attention is causal *bottom-right aligned*: new query ``i`` sees cached
positions ``< sequence_offset`` and new positions ``<= i``. A sliding-window layer (``--window-size``)
asks :meth:`KVCache.query_positions` for the new tokens' positions and masks the keys before its
window (:func:`~megatron_lite.parallel.sliding_window.cache_window_mask`); every token stays cached
(``first_key`` is 0: the keys returned start at position 0). A rolling buffer is not built here:
this cache serves one static batch (and beam search) at the model's whole length; the continuous
batch's paged cache returns the blocks beyond every window.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, max_batch_size: int, max_sequence_length: int):
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(f"a key/value cache needs a positive batch size and length, got "
                             f"{max_batch_size} x {max_sequence_length}")
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.sequence_offset = 0
        self.first_key = 0  # the position of the first key append returns (every token is kept)
        self.memory: dict[int, tuple[torch.Tensor, ...]] = {}

    def append(self, layer_number: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store the new tokens' ``tensors`` (each ``[s_new, b, ...]``) of layer ``layer_number`` at
        positions ``[sequence_offset, sequence_offset + s_new)``; return views ``[sequence_offset +
        s_new, b, ...]`` of everything cached for this layer, in the same order."""
        s_new, b = tensors[0].shape[:2]
        end = self.sequence_offset + s_new
        if end > self.max_sequence_length or b > self.max_batch_size:
            raise ValueError(f"the key/value cache holds {self.max_batch_size} sequences of "
                             f"{self.max_sequence_length} tokens; asked for {b} x {end}")
        if layer_number not in self.memory:
            self.memory[layer_number] = tuple(
                torch.empty(self.max_sequence_length, self.max_batch_size, *t.shape[2:], dtype=t.dtype, device=t.device)
                for t in tensors
            )
        stored = self.memory[layer_number]
        if len(stored) != len(tensors):
            raise ValueError(f"layer {layer_number} cached {len(stored)} tensors, now appends {len(tensors)}")
        out = []
        for cache, new in zip(stored, tensors):
            cache[self.sequence_offset:end, :b] = new
            out.append(cache[:end, :b])
        return tuple(out)

    def query_positions(self, s_new: int) -> torch.Tensor:
        """Positions ``[1, s_new]`` of the new tokens of every row (sliding-window attention's mask)."""
        return torch.arange(self.sequence_offset, self.sequence_offset + s_new).unsqueeze(0)

    def advance(self, num_tokens: int) -> None:
        """Count ``num_tokens`` new tokens as cached (after a forward pass over them)."""
        self.sequence_offset += num_tokens

    def truncate(self, length: int) -> None:
        """Forget the tokens from position ``length`` on (speculative decoding's rejected drafts): the
        next :meth:`append` writes over them, and attention never reads past what it appended."""
        if not 0 <= length <= self.sequence_offset:
            raise ValueError(f"cannot truncate a key/value cache of {self.sequence_offset} tokens to {length}")
        self.sequence_offset = length

    def reorder(self, rows: torch.Tensor) -> None:
        """Make cached sequence ``i`` a copy of sequence ``rows[i]``, in every layer's every tensor
        (beam search: beam ``i`` continues beam ``rows[i]``)."""
        for stored in self.memory.values():
            for cache in stored:
                cache[:self.sequence_offset, :len(rows)] = cache[:self.sequence_offset, rows]

    def reset(self) -> None:
        """Forget every cached token (the memory stays allocated for the next batch)."""
        self.sequence_offset = 0


def causal_mask_with_offset(q_len: int, k_len: int, device) -> torch.Tensor:
    """Bool ``[q_len, k_len]``, True = masked out: query ``i`` (at position ``k_len - q_len + i``)
    sees keys ``<= k_len - q_len + i`` (bottom-right aligned causal mask)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(k_len - q_len + 1)
