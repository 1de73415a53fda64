"""GPT: embedding -> pre-norm transformer layers -> final norm -> output layer -> loss.

Reads like a single-device GPT; the tensor-parallel layers and the two collectives around the
output layer are the only difference. One ``GPTModel`` holds one pipeline chunk: global layers
``[layer_start, layer_end)``, plus the embedding when ``pre_process`` (first stage) and the final
norm, output layer and loss when ``post_process`` (last stage).

Output layer: logits ``[s, b, V/tp]`` are this rank's vocabulary slice. The input is entered into
the TP region with ``copy_to_tp`` (or all-gathered along the sequence under SP), multiplied by the
vocab-split weight, and the loss is computed by ``vocab_parallel_cross_entropy`` without ever
gathering the logits; ``vocab_size`` is the real vocabulary, so the padded tail never counts.
With tied weights the output layer reuses the word-embedding weight. On a pipeline's last stage,
which has no embedding, it owns a copy drawn from the same seeded init (so it starts identical);
both copies carry ``shared_embedding = True`` and their gradients are summed over the embedding
group by the training code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import comm
from ..parallel.cross_entropy import vocab_parallel_cross_entropy
from ..parallel.tensor import ColumnParallelLinear
from .common import rotary_cos_sin, seeded_init
from .embedding import WORD_EMBEDDING, Embedding
from .transformer import TransformerBlock

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")


def tensor_parallel_meta(module: nn.Module) -> dict:
    """``{name: {"partition_dim", "partition_stride"}}`` for the tensor-parallel parameters (the
    ``param_meta`` a checkpoint stores so a tool can :func:`~megatron_lite.parallel.tensor.unshard` them)."""
    return {
        name: {"partition_dim": p.partition_dim, "partition_stride": getattr(p, "partition_stride", 1)}
        for name, p in module.named_parameters()
        if getattr(p, "tensor_model_parallel", False)
    }


class GPTModel(nn.Module):
    def __init__(self, config, state, *, seed: int = 1234, sequence_parallel: bool = False,
                 recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                 pre_process: bool = True, post_process: bool = True, layer_start: int = 0,
                 layer_end: int | None = None, params_dtype=torch.float32):
        super().__init__()
        _check_config(config, state.tp_size)
        self.config, self.state = config, state
        self.tp_group = state.tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel and state.tp_size > 1
        self.tied = not config.untie_embeddings_and_output_weights
        self.vocab_size = config.vocab_size or config.padded_vocab_size
        self.use_rope = config.position_embedding_type == "rope"
        self.head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.input_tensor = None
        self.layer_start = layer_start  # global layer range held here (saved in checkpoints' layer_ranges)
        self.layer_end = config.num_layers if layer_end is None else layer_end

        self.embedding = None
        if pre_process:
            self.embedding = Embedding(config, state, seed=seed, sequence_parallel=sequence_parallel,
                                       params_dtype=params_dtype)
        self.decoder = TransformerBlock(
            config, state, seed=seed, layer_start=layer_start, layer_end=layer_end, post_process=post_process,
            attn_mask_type="causal", sequence_parallel=sequence_parallel,
            recompute_granularity=recompute_granularity, recompute_method=recompute_method,
            recompute_num_layers=recompute_num_layers, params_dtype=params_dtype,
        )
        self.output_layer = None
        if post_process and not (self.tied and pre_process):
            # untied: its own weight; tied on a last stage without the embedding: a copy of it
            layer, name = (0, WORD_EMBEDDING) if self.tied else (config.num_layers + 1, "output_layer.weight")
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, self.tp_group, bias=False,
                init_method=seeded_init(seed, layer, name, config.init_method_std),
                sequence_parallel=sequence_parallel, dtype=params_dtype,
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

    def param_meta(self) -> dict:
        return tensor_parallel_meta(self)

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
            rotary = rotary_cos_sin(position_ids, self.head_dim, self.config.rotary_base)
        hidden = self.decoder(hidden, attention_mask, rotary)
        if not self.post_process:
            return hidden
        logits = self._logits(hidden)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous(), self.tp_group, vocab_size=self.vocab_size)
        return loss.t().contiguous()

    def _logits(self, hidden):
        if self.output_layer is not None:
            return self.output_layer(hidden)
        # tied, single stage: the ColumnParallelLinear computation with the embedding's weight
        if self.sequence_parallel:
            hidden = comm.gather_from_sp(hidden, self.tp_group, tensor_parallel_output_grad=True)
        else:
            hidden = comm.copy_to_tp(hidden, self.tp_group)
        return F.linear(hidden, self.embedding.word_embeddings.weight)


def _check_config(config, tp: int) -> None:
    """Shape errors as one clear message each (config.finalize normally catches them first)."""
    if config.padded_vocab_size is None:
        raise ValueError("config.padded_vocab_size is not set: use padded_vocab_size(vocab_size, "
                         "make_vocab_size_divisible_by, tensor_model_parallel_size)")
    if config.padded_vocab_size % tp:
        raise ValueError(f"padded vocabulary size {config.padded_vocab_size} is not divisible by "
                         f"tensor-model-parallel-size {tp}")
    if config.vocab_size is not None and config.vocab_size > config.padded_vocab_size:
        raise ValueError(f"vocab size {config.vocab_size} is larger than the padded vocab size {config.padded_vocab_size}")
    if config.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ValueError(f"--position-embedding-type {config.position_embedding_type!r} is not one of "
                         f"{', '.join(POSITION_EMBEDDING_TYPES)}")
    if config.kv_channels is None and config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden-size {config.hidden_size} is not divisible by num-attention-heads "
                         f"{config.num_attention_heads}; set --kv-channels")
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    if config.position_embedding_type == "rope" and head_dim % 2:
        raise ValueError(f"rope needs an even head dimension, got {head_dim} (--kv-channels)")
    if config.num_attention_heads % tp:
        raise ValueError(f"num-attention-heads {config.num_attention_heads} is not divisible by "
                         f"tensor-model-parallel-size {tp}")
