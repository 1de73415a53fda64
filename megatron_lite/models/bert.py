"""BERT: embedding -> pre-norm bidirectional transformer layers -> final norm -> LM head + sentence-order head.

Megatron's BERT, which differs from the original post-LayerNorm BERT: every layer normalises its
input (``x + attn(norm(x))``, ``x + mlp(norm(x))``; ``--apply-residual-connection-post-layernorm`` adds to
``norm(x)`` instead, see :mod:`~megatron_lite.models.transformer`) and the encoder ends with a final norm. One
``BertModel`` is one pipeline chunk (see :class:`~megatron_lite.models.language_model.LanguageModel`
for the embedding, the vocab-parallel output layer, weight tying over pipeline stages and the
pipeline hooks, all shared with GPT):

* embedding: word + learned position embeddings, plus token-type embeddings (segment A = 0, B = 1)
  when ``num_tokentypes > 0``; Megatron builds them only with the binary head (2 types, else 0);
* ``encoder``: the shared :class:`~megatron_lite.models.transformer.TransformerBlock` with the
  padding mask (bidirectional). ``padding_mask [b, s]`` (1 real, 0 padding) becomes a key mask:
  no query attends to a padding key. Padding *queries* still attend to the real keys, so their
  rows are finite (a fully masked row would be NaN and spread into later layers); they never
  reach a real position or the loss;
* ``lm_head``: dense h -> h, GeLU, norm, on this rank's sequence shard under SP (replicated
  weights marked ``sequence_parallel``); then the output layer, tied to the word embedding by
  default, with its own bias (split over the vocabulary like the weight);
* ``pooler``: dense h -> h + tanh on the [CLS] (first) position; under SP the sequence is
  all-gathered first, with a split (not reduce-scattered) gradient, because every TP rank computes
  the same pooled vector; ``binary_head``: linear h -> 2 (sentence-order prediction).

Heads are on the last stage (``post_process``). Their weights are seeded as the output layer's
global layer (``num_layers + 1``), so any TP/PP layout holds the single-process weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import comm
from .common import Norm, init_replicated
from .language_model import LanguageModel
from .spec import bert_layer_spec
from .transformer import TransformerBlock


def replicated_linear(config, in_features: int, out_features: int, name: str,
                      sequence_parallel: bool = False) -> nn.Linear:
    """A linear layer held whole on every TP rank (a head's dense), seeded as the output layer's
    global layer; ``sequence_parallel`` marks weights that only see this rank's sequence shard."""
    linear = nn.Linear(in_features, out_features, dtype=config.params_dtype)
    init_replicated(linear.weight, config.init_method(config.num_layers + 1, f"{name}.weight"))
    with torch.no_grad():
        linear.bias.zero_()
    linear.weight.sequence_parallel = linear.bias.sequence_parallel = sequence_parallel
    return linear


def bert_attention_mask(padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``padding_mask [b, s]`` (1 real / 0 padding) -> bool ``[b, 1, s, s]``, True = masked out:
    every query ignores the padding keys. None stays None (no padding)."""
    if padding_mask is None:
        return None
    b, s = padding_mask.shape
    return (padding_mask < 0.5)[:, None, None, :].expand(b, 1, s, s)


class BertLMHead(nn.Module):
    """dense h -> h, GeLU (erf), norm: the transform before the output layer."""

    def __init__(self, config):
        super().__init__()
        self.dense = replicated_linear(config, config.hidden_size, config.hidden_size, "lm_head.dense",
                                       sequence_parallel=config.sequence_parallel)
        self.layer_norm = Norm.from_config(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden)))


class Pooler(nn.Module):
    """tanh(dense(hidden of the first token)): ``[s(/tp), b, h]`` -> ``[b, h]``."""

    def __init__(self, config, state):
        super().__init__()
        self.tp_group = state.tp_group
        self.sequence_parallel = config.sequence_parallel
        self.dense = replicated_linear(config, config.hidden_size, config.hidden_size, "pooler.dense")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # [CLS] is in TP rank 0's shard; every rank pools the same vector
            hidden = comm.gather_from_sp(hidden, self.tp_group, tensor_parallel_output_grad=False)
        return torch.tanh(self.dense(hidden[0]))


class BertModel(LanguageModel):
    """One pipeline chunk of a BERT: ``config`` is a :class:`~megatron_lite.models.transformer_config.TransformerConfig`."""

    def __init__(self, config, state, *, spec=None, num_tokentypes: int = 2, add_binary_head: bool = True,
                 pre_process: bool = True, post_process: bool = True, layer_start: int = 0,
                 layer_end: int | None = None):
        super().__init__(config, state, pre_process=pre_process, post_process=post_process,
                         layer_start=layer_start, layer_end=layer_end, num_tokentypes=num_tokentypes)
        self.num_tokentypes, self.add_binary_head = num_tokentypes, add_binary_head
        self.encoder = TransformerBlock(config, state, spec if spec is not None else bert_layer_spec(config),
                                        layer_start=layer_start, layer_end=layer_end, post_process=post_process,
                                        attn_mask_type="padding")
        self.lm_head = self.pooler = self.binary_head = None
        if post_process:
            self.lm_head = BertLMHead(config)
            self._build_output_layer(bias=True)
            if add_binary_head:
                self.pooler = Pooler(config, state)
                self.binary_head = replicated_linear(config, config.hidden_size, 2, "binary_head")
        self._mark_shared_weight()

    def forward(self, tokens, padding_mask=None, tokentype_ids=None, lm_labels=None, position_ids=None):
        """``tokens``, ``padding_mask`` (1 real / 0 padding), ``tokentype_ids``, ``lm_labels``: ``[b, s]``.

        Last stage: ``(lm_output, binary_logits)`` with ``lm_output`` the per-token MLM loss
        ``[b, s]`` (given ``lm_labels``; every position, the caller masks) or the logits shard
        ``[b, s, padded_vocab/tp]``, and ``binary_logits [b, 2]`` (None without the binary head).
        Other stages: the hidden states for the next stage.
        """
        types = tokentype_ids if self.num_tokentypes > 0 else None
        hidden = self._input_hidden(tokens, position_ids, types)
        hidden = self.encoder(hidden, bert_attention_mask(padding_mask), self._rotary(hidden, position_ids))
        if not self.post_process:
            return hidden
        binary_logits = self.binary_head(self.pooler(hidden)) if self.add_binary_head else None
        lm_output = self._lm_output(self._logits(self.lm_head(hidden)), lm_labels)
        return lm_output, binary_logits
