"""What GPT and BERT share around their transformer block: one pipeline chunk of a language model.

A chunk holds global layers ``[layer_start, layer_end)``, the embedding when ``pre_process`` (first
pipeline stage) and the output layer when ``post_process`` (last stage). This base class owns the
pieces that do not depend on the block's attention mask or on the heads:

* the :class:`~megatron_lite.models.embedding.Embedding` (word + learned positions, plus token types
  when ``num_tokentypes > 0``);
* the vocab-parallel output layer: logits ``[s, b, V/tp]`` are this rank's vocabulary slice. The
  input is entered into the TP region with ``copy_to_tp`` (or all-gathered along the sequence under
  SP), multiplied by the vocab-split weight, and the loss is computed by
  ``vocab_parallel_cross_entropy`` without ever gathering the logits; ``vocab_size`` is the real
  vocabulary, so the padded tail never counts;
* weight tying: with tied weights the output layer reuses the word-embedding weight. On a single
  stage it is a ColumnParallelLinear without a weight of its own, called with ``weight=`` the
  embedding's (so the logits go through the same GEMM seam as every other linear). On a pipeline's
  last stage, which has no embedding, it owns a copy drawn from the same seeded init (so it starts
  identical); both copies carry ``shared_embedding = True`` and their gradients are summed over the
  embedding group by the training code;
* multi-token prediction (``--mtp-num-layers``) reads the word embedding on the last stage: a last
  stage without the embedding builds its own copy of it (``embedding`` with ``embedding=True``,
  drawn from the same seeded init). The embedding weight is then the shared one on the first and
  the last stage, tied or not (Megatron-LM's rule: shared when tied *or* with MTP), and a tied
  output layer there reads it instead of owning ``output_layer.weight``;
* the pipeline hooks ``set_input_tensor`` and ``shared_embedding_or_output_weight``, and the rotary
  tables when ``--position-embedding-type rope``;
* under context parallelism a rank holds two load-balanced chunks of the sequence: missing
  ``position_ids`` default to their global positions (not ``0..s-1``), for learned and rotary
  positions alike.

Subclasses build their block (after calling ``__init__``, so parameters keep the order embedding,
block, heads) and their heads with :meth:`_build_output_layer`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.context import cp_positions
from ..parallel.cross_entropy import vocab_parallel_cross_entropy
from ..parallel.tensor import ColumnParallelLinear
from .embedding import WORD_EMBEDDING, Embedding
from .yarn import rotary_tables


class LanguageModel(nn.Module):
    """Base of :class:`~megatron_lite.models.gpt.GPTModel` and :class:`~megatron_lite.models.bert.BertModel`."""

    def __init__(self, config, state, *, pre_process: bool, post_process: bool, layer_start: int,
                 layer_end: int | None, num_tokentypes: int = 0, embedding: bool | None = None):
        """``embedding``: build the embedding (default: on the first stage)."""
        super().__init__()
        if config.padded_vocab_size is None:
            raise ValueError("the model config has no vocabulary size: pass --vocab-size or a --tokenizer-type "
                             "(from Python: TransformerConfig.vocab_size, or padded_vocab_size)")
        self.config, self.state = config, state
        self.tp_group = state.tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = config.sequence_parallel
        self.tied = not config.untie_embeddings_and_output_weights
        self.vocab_size = config.vocab_size or config.padded_vocab_size
        self.use_rope = config.position_embedding_type == "rope"
        self.input_tensor = None
        self.layer_start = layer_start  # global layer range held here (saved in checkpoints' layer_ranges)
        self.layer_end = config.num_layers if layer_end is None else layer_end
        embedding = pre_process if embedding is None else embedding
        self.embedding = Embedding(config, state, num_tokentypes=num_tokentypes) if embedding else None
        self.output_layer = None

    def _build_output_layer(self, bias: bool) -> None:
        """The vocab-parallel output layer (last stage only); call after the block is built."""
        config = self.config
        # untied: its own weight; tied on a last stage without the embedding: a copy of it;
        # tied with the embedding here: no weight of its own (forward passes the embedding's)
        layer, name = (0, WORD_EMBEDDING) if self.tied else (config.num_layers + 1, "output_layer.weight")
        self.output_layer = ColumnParallelLinear(
            config.hidden_size, config.padded_vocab_size, self.tp_group, bias=bias,
            init_method=config.init_method(layer, name), sequence_parallel=self.sequence_parallel,
            skip_weight_param_allocation=self.tied and self.embedding is not None,
            gemm=config.make_gemm(0, self.tp_group), dtype=config.params_dtype,  # 0: outside the layers
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        )
        self.output_layer.sharding_unit = True  # a ZeRO-3 unit (parallel/fsdp.py)

    def _mark_shared_weight(self) -> None:
        shared = self.shared_embedding_or_output_weight()
        if shared is not None:
            shared.shared_embedding = True
        # --decoupled-lr: the word embedding and the output layer (a tied copy included) get their own lr
        for weight in (self.embedding and self.embedding.word_embeddings.weight,
                       self.output_layer is not None and self.output_layer.weight):
            if isinstance(weight, torch.Tensor):
                weight.is_embedding_or_output_parameter = True

    # -- pipeline helpers ---------------------------------------------------------------------
    def set_input_tensor(self, x) -> None:
        """The hidden states ``[s(/tp), b, h]`` from the previous pipeline stage (a tensor or a list of one)."""
        self.input_tensor = x[0] if isinstance(x, (list, tuple)) else x

    def shared_embedding_or_output_weight(self):
        """The word-embedding weight shared by the first and last stage held by this chunk (tied
        weights, or a last stage's copy for multi-token prediction), else None."""
        if not (self.tied or getattr(self.config, "mtp_num_layers", None)):
            return None
        if self.embedding is not None:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def num_parameters(self) -> int:
        """Parameters held by this rank (tensor-parallel shards counted at their local size)."""
        return sum(p.numel() for p in self.parameters())

    def _cp_position_ids(self, batch: int, local_len: int, device) -> torch.Tensor:
        """Global positions ``[b, s/cp]`` of this context-parallel rank's tokens (its two chunks)."""
        cp = self.state.cp_size
        return cp_positions(local_len * cp, self.state.cp_rank, cp, device).unsqueeze(0).expand(batch, -1)

    # -- forward pieces ------------------------------------------------------------------------
    def _input_hidden(self, tokens, position_ids=None, tokentype_ids=None) -> torch.Tensor:
        """The embedded ``tokens [b, s]`` on the first stage, else the previous stage's hidden states."""
        if not self.pre_process:
            if self.input_tensor is None:
                raise RuntimeError(f"{type(self).__name__} without pre_process needs set_input_tensor() before forward")
            return self.input_tensor
        tp = self.state.tp_size
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if self.sequence_parallel and tokens.shape[1] % tp:
            raise ValueError(f"--sequence-parallel (TransformerConfig.sequence_parallel) needs the sequence length "
                             f"{tokens.shape[1]} of this context-parallel rank divisible by --tensor-model-parallel-size "
                             f"{tp}: give tokens of --seq-length, a multiple of --tensor-model-parallel-size x "
                             "--context-parallel-size")
        if position_ids is None and self.state.cp_size > 1:  # this CP rank's chunks sit at global positions
            position_ids = self._cp_position_ids(tokens.shape[0], tokens.shape[1], tokens.device)
        return self.embedding(tokens, None if self.use_rope else position_ids, tokentype_ids)

    def _cached_positions(self, tokens, inference_context) -> torch.Tensor:
        """Positions ``[b, s]`` of new tokens after the ``sequence_offset`` cached ones (on any stage:
        ``tokens`` is the input ids on the first, the hidden states ``[s, b, h]`` on later ones)."""
        ref = tokens if self.pre_process else self.input_tensor
        b, s = ref.shape if self.pre_process else ref.shape[1::-1]
        start = inference_context.sequence_offset
        return torch.arange(start, start + s, device=ref.device).unsqueeze(0).expand(b, -1)

    def _rotary(self, hidden, position_ids=None):
        """(cos, sin) tables for the full sequence of ``hidden [s(/tp), b, h]``, or None without rope
        (MLA's rotary part, YaRN-scaled with ``--rope-type yarn``: :mod:`~megatron_lite.models.yarn`)."""
        if not self.use_rope:
            return None
        s = hidden.shape[0] * (self.state.tp_size if self.sequence_parallel else 1)
        if position_ids is None and self.state.cp_size > 1:
            position_ids = self._cp_position_ids(hidden.shape[1], s, hidden.device)
        elif position_ids is None:
            position_ids = torch.arange(s, device=hidden.device).unsqueeze(0).expand(hidden.shape[1], -1)
        return rotary_tables(self.config, position_ids)

    def _logits(self, hidden, last_use: bool = True) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, ``[s, b, V/tp]``; ``last_use=False`` for a head
        whose gradient reaches the output weight before another's (see ColumnParallelLinear.forward)."""
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        return self.output_layer(hidden, weight=weight, last_use=last_use)

    def _lm_output(self, logits, labels):
        """Per-token loss ``[b, s]`` against ``labels [b, s]``, or the logits shard ``[b, s, V/tp]`` without labels."""
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous(), self.tp_group, vocab_size=self.vocab_size,
                                            fused=self.config.cross_entropy_loss_fusion, in_place=True)
        return loss.t().contiguous()
