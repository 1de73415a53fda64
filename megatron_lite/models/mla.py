"""Multi-latent attention (MLA, DeepSeek-V2/V3): queries, keys and values from low-rank latents.

Per token (``n`` heads; ``dn`` = qk_head_dim, ``dr`` = qk_pos_emb_head_dim, ``dv`` = v_head_dim,
``rq`` = q_lora_rank, ``rkv`` = kv_lora_rank):

* queries ``[s, b, n, dn + dr]``: ``linear_q_proj(x)`` without q compression, else
  ``linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))``; each head is ``[nope | rope]``;
* ``linear_kv_down_proj(x)`` gives ``[latent rkv | k_rope dr]``: the latent is normed
  (``kv_layernorm``) and expanded by ``linear_kv_up_proj`` into per-head ``[k_nope dn | v dv]``;
  ``k_rope`` is ONE rotary key per token, shared by every head (MQA-like);
* the rotary parts of queries and of the shared key are de-interleaved (``[x0, x2, ... | x1, x3,
  ...]``) and rotated rotate-half style by the model's tables (YaRN with ``--rope-type yarn``),
  which equals DeepSeek's / Hugging Face's interleaved complex-pair rotation (q and k are permuted
  alike, so the scores are unchanged and checkpoint weights copy 1:1);
* ``q = [q_nope | q_rope]`` and ``k = [k_nope | k_rope]`` (``dn + dr`` channels) attend to ``v``
  (``dv`` channels: core attention takes a value head size of its own) with the scale
  ``mscale^2 / sqrt(dn + dr)`` (:func:`~megatron_lite.models.yarn.mla_softmax_scale`);
* ``linear_proj`` maps ``[s, b, n dv]`` back to the hidden size.

Parameters and tensor parallelism (``t`` = TP size; Megatron's layout and names, so checkpoints
convert by name):

================================  ==================  =========================================
parameter                         full shape          over TP
================================  ==================  =========================================
``linear_q_proj.weight``          ``[n (dn+dr), h]``  column-parallel: rows = whole heads
``linear_q_down_proj.weight``     ``[rq, h]``         replicated ("duplicated")
``q_layernorm.weight``            ``[rq]``            replicated (with ``--qk-layernorm``)
``linear_q_up_proj.weight``       ``[n (dn+dr), rq]`` column-parallel: rows = whole heads
``linear_kv_down_proj.weight``    ``[rkv + dr, h]``   replicated; rows ``[latent | k_rope]``
``kv_layernorm.weight``           ``[rkv]``           replicated (with ``--qk-layernorm``)
``linear_kv_up_proj.weight``      ``[n (dn+dv), rkv]`` column-parallel: rows per head ``[k_nope | v]``
``linear_proj.weight`` (+ bias)   ``[h, n dv]``       row-parallel: columns = whole heads
================================  ==================  =========================================

The q/kv projections have no bias (as in Megatron-LM); ``linear_proj`` has one unless
``--disable-bias-linear``. The norms use ``--normalization`` / ``--norm-epsilon``. The fusion flags act as
in :class:`~megatron_lite.models.attention.SelfAttention`: ``--rope-fusion`` rotates through a ``jit_fuser``
function, and with ``--bias-dropout-fusion`` ``linear_proj`` leaves its bias to the layer's fused residual.

Communication. The down projections run redundantly on every TP rank. Under sequence parallelism
they see this rank's sequence shard ``[s/t, b, h]``: their weights and the latent norms carry
``sequence_parallel = True`` (gradients summed over TP), the up projections all-gather the normed
latents along the sequence, and ``k_rope`` is all-gathered (its gradient reduce-scattered: every
rank's heads used it). Without sequence parallelism ``k_rope`` enters the TP region with
``copy_to_tp`` (its gradient all-reduced over the ranks' heads), like the up projections' inputs.

Inference: with ``inference_context`` (a :class:`~megatron_lite.inference.kv_cache.KVCache`) the
layer caches its normed latent ``[s, b, rkv]`` and rotated shared key ``[s, b, 1, dr]`` (not the
per-head keys and values) and expands every cached latent again; ``rotary`` then holds the tables
of the new tokens' positions, and attention is causal bottom-right aligned.
"""

from __future__ import annotations

import torch
from torch import nn

from ..fusions.jit import jit_fuser
from ..inference.kv_cache import causal_mask_with_offset
from ..parallel import comm
from ..parallel.random import checkpoint
from ..parallel.recompute import recompute_modules
from ..parallel.tensor import linear_gemm
from .attention import DotProductAttention
from .common import Norm, apply_rotary, column_linear, init_replicated, row_linear


def apply_mla_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the rotary part ``x [s, b, heads, dr]`` as MLA does: de-interleave, then rotate-half."""
    return apply_rotary(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), cos, sin)


fused_apply_mla_rotary = jit_fuser(apply_mla_rotary)  # --rope-fusion (Megatron's fused MLA rope)


class DuplicatedLinear(nn.Module):
    """``x @ weight^T`` with the full weight on every TP rank (Megatron's "duplicated" linear).

    Under sequence parallelism each rank multiplies only its sequence shard, so the weight is
    marked ``sequence_parallel`` and its gradient is summed over TP by the training code.
    """

    def __init__(self, config, state, layer_number: int, input_size: int, output_size: int, name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_replicated(self.weight, config.init_method(layer_number, f"{name}.weight"))
        self.weight.sequence_parallel = config.sequence_parallel
        self.gemm = config.make_gemm(layer_number, state.group("tp_cp")) or linear_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, None)


class MLASelfAttention(nn.Module):
    """The layer spec's ``self_attention`` for ``--multi-latent-attention`` (see the module docstring)."""

    def __init__(self, config, state, layer_number: int, *, core_attention=DotProductAttention):
        super().__init__()
        self.layer_number = layer_number
        self.tp_group, self.sequence_parallel = state.tp_group, config.sequence_parallel
        n = config.num_attention_heads
        self.local_heads = n // state.tp_size
        self.dn, self.dr, self.dv = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        modules = recompute_modules(config)
        self.selective_recompute, self.recompute_up_proj = "core_attn" in modules, "mla_up_proj" in modules
        self.tracker = state.rng_tracker
        q_size, prefix = n * (self.dn + self.dr), "self_attention."
        self.q_compressed = config.q_lora_rank is not None
        if not self.q_compressed:
            self.linear_q_proj = column_linear(config, state, layer_number, q_size, prefix + "linear_q_proj", bias=False)
        else:
            self.linear_q_down_proj = DuplicatedLinear(config, state, layer_number, config.hidden_size,
                                                       config.q_lora_rank, prefix + "linear_q_down_proj")
            self.q_layernorm = self._latent_norm(config, config.q_lora_rank)
            self.linear_q_up_proj = column_linear(config, state, layer_number, q_size, prefix + "linear_q_up_proj",
                                                  input_size=config.q_lora_rank, bias=False)
        self.linear_kv_down_proj = DuplicatedLinear(config, state, layer_number, config.hidden_size,
                                                    self.kv_lora_rank + self.dr, prefix + "linear_kv_down_proj")
        self.kv_layernorm = self._latent_norm(config, self.kv_lora_rank)
        self.linear_kv_up_proj = column_linear(config, state, layer_number, n * (self.dn + self.dv),
                                               prefix + "linear_kv_up_proj", input_size=self.kv_lora_rank, bias=False)
        self.core_attention = core_attention(config, state, layer_number)
        self.linear_proj = row_linear(config, state, layer_number, n * self.dv, prefix + "linear_proj",
                                      skip_bias_add=config.bias_dropout_fusion)  # (output, bias): fused in the layer
        self.rotate = fused_apply_mla_rotary if config.apply_rope_fusion else apply_mla_rotary

    @staticmethod
    def _latent_norm(config, size: int):
        if not config.qk_layernorm:
            return None
        return Norm(size, config.normalization, config.norm_epsilon, sequence_parallel=config.sequence_parallel,
                    dtype=config.params_dtype, zero_centered=config.apply_layernorm_1p)

    def _query_input(self, hidden):
        """What the query projection reads: ``hidden``, or with q compression its normed latent."""
        if not self.q_compressed:
            return hidden
        latent = self.linear_q_down_proj(hidden)
        return latent if self.q_layernorm is None else self.q_layernorm(latent)

    def _latent_and_rope_key(self, hidden):
        """(normed latent ``[s(/t), b, rkv]``, shared rotary key ``[s, b, dr]`` in the TP region)."""
        latent, k_rope = self.linear_kv_down_proj(hidden).split([self.kv_lora_rank, self.dr], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        if self.sequence_parallel:
            k_rope = comm.gather_from_sp(k_rope, self.tp_group, tensor_parallel_output_grad=True)
        else:
            k_rope = comm.copy_to_tp(k_rope, self.tp_group)
        return latent, k_rope

    def forward(self, hidden, attention_mask=None, rotary=None, causal: bool = True, inference_context=None):
        """``hidden [s(/tp), b, h]`` -> ``[s(/tp), b, h]`` (``(output, bias)`` with bias + dropout fusion, the
        bias left to the layer); ``rotary`` is (cos, sin) ``[s, b, 1, dr]`` or None."""
        q_input = self._query_input(hidden)
        latent, k_rope = self._latent_and_rope_key(hidden)
        cos, sin = rotary if rotary is not None else (None, None)
        if self.recompute_up_proj and inference_context is None and torch.is_grad_enabled():
            # --recompute-modules mla_up_proj: up projections, rotary and core attention run again in backward
            context = checkpoint(self._attend, q_input, latent, k_rope, cos, sin, attention_mask, causal, None, False,
                                 tracker=self.tracker)
        else:
            context = self._attend(q_input, latent, k_rope, cos, sin, attention_mask, causal, inference_context,
                                   self.selective_recompute)
        return self.linear_proj(context)

    def _attend(self, q_input, latent, k_rope, cos, sin, attention_mask, causal, inference_context,
                recompute_core: bool):
        """Up projections, rotary embedding, per-head Q/K/V and core attention -> context."""
        q = self.linear_q_proj(q_input) if not self.q_compressed else self.linear_q_up_proj(q_input)
        q_nope, q_rope = q.view(q.shape[0], q.shape[1], self.local_heads, self.dn + self.dr).split(
            [self.dn, self.dr], dim=-1)
        k_rope = k_rope.unsqueeze(2)  # [s, b, 1, dr]: one key for every head
        if cos is not None:
            cos, sin = cos.to(q_nope.dtype), sin.to(q_nope.dtype)
            q_rope, k_rope = self.rotate(q_rope, cos, sin), self.rotate(k_rope, cos, sin)
        if inference_context is not None:
            latent, k_rope, attention_mask, causal = self._cached(inference_context, latent, k_rope, attention_mask,
                                                                  causal, q_nope.shape[0])
        kv = self.linear_kv_up_proj(latent)
        k_nope, value = kv.view(kv.shape[0], kv.shape[1], self.local_heads, self.dn + self.dv).split(
            [self.dn, self.dv], dim=-1)
        value = value.contiguous()  # a saved view would keep k_nope's half of ``kv`` alive for backward
        query = torch.cat([q_nope, q_rope], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(-1, -1, self.local_heads, -1)], dim=-1)
        if recompute_core and torch.is_grad_enabled():
            return checkpoint(self.core_attention, query, key, value, attention_mask, causal, tracker=self.tracker)
        return self.core_attention(query, key, value, attention_mask, causal)

    def _cached(self, cache, latent, k_rope, attention_mask, causal, q_len):
        """Append the new tokens' latent and rotary key; return every cached one and the mask."""
        if self.sequence_parallel:
            raise ValueError("MLA with a key/value cache runs without sequence parallelism")
        latent, k_rope = cache.append(self.layer_number, latent, k_rope)
        k_len = latent.shape[0]
        if k_len == q_len or not causal:
            return latent, k_rope, attention_mask, causal
        mask = causal_mask_with_offset(q_len, k_len, latent.device)[None, None]  # [1, 1, sq, sk]
        return latent, k_rope, mask if attention_mask is None else mask | attention_mask, False
