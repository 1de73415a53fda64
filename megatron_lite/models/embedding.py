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
from torch import nn

from ..fusions.dropout import dropout
from ..parallel import comm
from ..parallel.tensor import VocabParallelEmbedding
from .common import init_replicated

WORD_EMBEDDING = "embedding.word_embeddings.weight"  # seed name, shared with a tied output layer


class Embedding(nn.Module):
    sharding_unit = True  # a ZeRO-3 unit (parallel/fsdp.py), unless the output layer reads its weight

    def __init__(self, config, state, *, num_tokentypes: int = 0):
        super().__init__()
        self.tp_group = state.tp_group
        self.sequence_parallel = config.sequence_parallel
        self.dropout_p = config.hidden_dropout
        self.tracker = state.rng_tracker
        self.fp32_residual = getattr(config, "fp32_residual_connection", False)  # the stream starts in fp32 here
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, self.tp_group, init_method=config.init_method(0, WORD_EMBEDDING),
            sequence_parallel=self.sequence_parallel, dtype=config.params_dtype,
            # multi-token prediction looks the table up again: its gradients then meet in .grad (the hook)
            gradient_accumulation_fusion=config.gradient_accumulation_fusion and not getattr(config, "mtp_num_layers", None),
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = self._replicated(config, config.max_position_embeddings,
                                                        "embedding.position_embeddings.weight")
        self.tokentype_embeddings = None
        if num_tokentypes > 0:
            self.tokentype_embeddings = self._replicated(config, num_tokentypes, "embedding.tokentype_embeddings.weight")

    def _replicated(self, config, rows, name):
        table = nn.Embedding(rows, config.hidden_size, dtype=config.params_dtype)
        init_replicated(table.weight, config.init_method(0, name))
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
        if self.fp32_residual:  # --fp32-residual-connection (Megatron casts here too, before dropout)
            hidden = hidden.float()
        if self.dropout_p > 0 and self.training:
            if self.sequence_parallel:  # every rank holds a different chunk: draw distinct masks per TP rank
                with self.tracker.fork():
                    hidden = dropout(hidden, self.dropout_p)
            else:
                hidden = dropout(hidden, self.dropout_p)
        return hidden
