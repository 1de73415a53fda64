"""Input embedding: word embeddings split over the vocabulary, optional learned positions and
token types (BERT), then dropout.

Input ids are ``[b, s]`` and are transposed to ``[s, b]`` so the output is ``[s, b, h]``. Under
sequence parallelism the word embedding's partial sums are reduce-scattered along the sequence,
so every rank continues with its shard ``[s/tp, b, h]``. Learned position and token-type
embeddings are replicated (not split over TP) and are added *after* the reduce-scatter, only for
this rank's shard; their weight gradients then cover only that shard, so these weights carry
``sequence_parallel = True`` and the training code sums their gradients over TP (the same
all-reduce that serves the norms). Adding them before the reduce-scatter would count them tp times.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import comm
from ..parallel.random import get_rng_tracker
from ..parallel.tensor import VocabParallelEmbedding
from .common import init_replicated, seeded_init

WORD_EMBEDDING = "embedding.word_embeddings.weight"  # seed name, shared with a tied output layer


class Embedding(nn.Module):
    def __init__(self, config, state, *, seed: int, sequence_parallel: bool = False, num_tokentypes: int = 0,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group = state.tp_group
        self.sequence_parallel = sequence_parallel and state.tp_size > 1
        self.dropout_p = config.hidden_dropout
        std = config.init_method_std
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, self.tp_group,
            init_method=seeded_init(seed, 0, WORD_EMBEDDING, std),
            sequence_parallel=self.sequence_parallel, dtype=params_dtype, device=device,
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            rows = config.max_position_embeddings or config.seq_length
            self.position_embeddings = self._replicated(rows, config.hidden_size, seed, "embedding.position_embeddings.weight",
                                                        std, params_dtype, device)
        self.tokentype_embeddings = None
        if num_tokentypes > 0:
            self.tokentype_embeddings = self._replicated(num_tokentypes, config.hidden_size, seed,
                                                         "embedding.tokentype_embeddings.weight", std, params_dtype, device)

    def _replicated(self, rows, cols, seed, name, std, dtype, device):
        table = nn.Embedding(rows, cols, dtype=dtype, device=device)
        init_replicated(table.weight, seeded_init(seed, 0, name, std))
        table.weight.sequence_parallel = self.sequence_parallel
        return table

    def _my_shard(self, ids_sb: torch.Tensor) -> torch.Tensor:
        """This rank's sequence chunk of ``[s, b]`` ids (plain slicing: no gradient flows to ids)."""
        if not self.sequence_parallel:
            return ids_sb
        size, rank = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        return ids_sb.chunk(size, dim=0)[rank]

    def forward(self, input_ids, position_ids=None, tokentype_ids=None) -> torch.Tensor:
        """``input_ids [b, s]`` -> hidden ``[s(/tp), b, h]``."""
        ids = input_ids.t().contiguous()
        hidden = self.word_embeddings(ids)  # all-reduced, or reduce-scattered under SP
        if self.position_embeddings is not None:
            if position_ids is None:
                rows = self.position_embeddings.num_embeddings
                if ids.shape[0] > rows:  # a shape check: no device sync
                    raise ValueError(f"sequence length {ids.shape[0]} is longer than the learned position table "
                                     f"({rows} rows); raise --max-position-embeddings")
                position_ids = torch.arange(ids.shape[0], device=ids.device).unsqueeze(0).expand(ids.shape[1], -1)
            hidden = hidden + self.position_embeddings(self._my_shard(position_ids.t()))
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                raise ValueError("this model has token-type embeddings; pass tokentype_ids [b, s]")
            hidden = hidden + self.tokentype_embeddings(self._my_shard(tokentype_ids.t()))
        if self.dropout_p > 0 and self.training:
            if self.sequence_parallel:  # every rank holds a different chunk: draw distinct masks per TP rank
                with get_rng_tracker().fork():
                    hidden = F.dropout(hidden, self.dropout_p, True)
            else:
                hidden = F.dropout(hidden, self.dropout_p, True)
        return hidden
