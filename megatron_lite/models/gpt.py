"""GPT: embedding -> pre-norm transformer layers -> final norm -> output layer -> loss.

Reads like a single-device GPT; the tensor-parallel layers and the two collectives around the
output layer are the only difference. One ``GPTModel`` holds one pipeline chunk: global layers
``[layer_start, layer_end)``, plus the embedding when ``pre_process`` (first stage) and the final
norm, output layer and loss when ``post_process`` (last stage).

Output layer: logits ``[s, b, V/tp]`` are this rank's vocabulary slice. The input is entered into
the TP region with ``copy_to_tp`` (or all-gathered along the sequence under SP), multiplied by the
vocab-split weight, and the loss is computed by ``vocab_parallel_cross_entropy`` without ever
gathering the logits; ``vocab_size`` is the real vocabulary, so the padded tail never counts.
With tied weights the output layer reuses the word-embedding weight: on a single stage it is a
ColumnParallelLinear without a weight of its own, called with ``weight=`` the embedding's (so the
logits go through the same GEMM seam as every other linear). On a pipeline's last stage, which has
no embedding, it owns a copy drawn from the same seeded init (so it starts identical); both copies
carry ``shared_embedding = True`` and their gradients are summed over the embedding group by the
training code.

The layers come from a layer spec (:func:`~megatron_lite.models.spec.gpt_layer_spec` unless one is
passed), so attention, MLP and norms can be swapped without touching this file.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.cross_entropy import vocab_parallel_cross_entropy
from ..parallel.tensor import ColumnParallelLinear
from .common import rotary_cos_sin
from .embedding import WORD_EMBEDDING, Embedding
from .spec import gpt_layer_spec
from .transformer import TransformerBlock


class GPTModel(nn.Module):
    """One pipeline chunk of a GPT: ``config`` is a :class:`~megatron_lite.models.transformer_config.TransformerConfig`."""

    def __init__(self, config, state, *, spec=None, pre_process: bool = True, post_process: bool = True,
                 layer_start: int = 0, layer_end: int | None = None):
        super().__init__()
        if config.padded_vocab_size is None:
            raise ValueError("the model config has no vocabulary size: set vocab_size (or padded_vocab_size)")
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

        self.embedding = Embedding(config, state) if pre_process else None
        self.decoder = TransformerBlock(config, state, spec if spec is not None else gpt_layer_spec(config),
                                        layer_start=layer_start, layer_end=layer_end, post_process=post_process,
                                        attn_mask_type="causal")
        self.output_layer = None
        if post_process:
            # untied: its own weight; tied on a last stage without the embedding: a copy of it;
            # tied with the embedding here: no weight of its own (forward passes the embedding's)
            layer, name = (0, WORD_EMBEDDING) if self.tied else (config.num_layers + 1, "output_layer.weight")
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, self.tp_group, bias=False,
                init_method=config.init_method(layer, name), sequence_parallel=self.sequence_parallel,
                skip_weight_param_allocation=self.tied and pre_process,
                gemm=config.make_gemm(config.num_layers + 1, self.tp_group), dtype=config.params_dtype,
            )
        shared = self.shared_embedding_or_output_weight()
        if shared is not None:
            shared.shared_embedding = True

    # -- pipeline helpers ---------------------------------------------------------------------
    def set_input_tensor(self, x) -> None:
        """The hidden states ``[s(/tp), b, h]`` from the previous pipeline stage (a tensor or a list of one)."""
        self.input_tensor = x[0] if isinstance(x, (list, tuple)) else x

    def shared_embedding_or_output_weight(self):
        """The tied embedding/output weight held by this chunk (first and last stage), else None."""
        if not self.tied:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def num_parameters(self) -> int:
        """Parameters held by this rank (tensor-parallel shards counted at their local size)."""
        return sum(p.numel() for p in self.parameters())

    # -- forward -------------------------------------------------------------------------------
    def forward(self, tokens, position_ids=None, attention_mask=None, labels=None):
        """See the module docstring; shapes: tokens/position_ids/labels ``[b, s]``, mask bool ``[b, 1, s, s]``.

        Returns the per-token loss ``[b, s]`` (last stage with labels), the logits shard
        ``[b, s, padded_vocab/tp]`` (last stage without labels) or the hidden states for the next stage.
        """
        tp = self.state.tp_size
        if self.pre_process:
            if tokens.dim() != 2:
                raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
            if self.sequence_parallel and tokens.shape[1] % tp:
                raise ValueError(f"sequence parallelism needs the sequence length {tokens.shape[1]} "
                                 f"divisible by tensor-model-parallel-size {tp}")
            hidden = self.embedding(tokens, None if self.use_rope else position_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError("GPTModel without pre_process needs set_input_tensor() before forward")
            hidden = self.input_tensor
        rotary = None
        if self.use_rope:
            s = hidden.shape[0] * (tp if self.sequence_parallel else 1)
            if position_ids is None:
                position_ids = torch.arange(s, device=hidden.device).unsqueeze(0).expand(hidden.shape[1], -1)
            rotary = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rotary_base)
        hidden = self.decoder(hidden, attention_mask, rotary)
        if not self.post_process:
            return hidden
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        logits = self.output_layer(hidden, weight=weight)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous(), self.tp_group, vocab_size=self.vocab_size)
        return loss.t().contiguous()
