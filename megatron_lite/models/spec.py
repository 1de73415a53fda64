"""Layer specs: which module fills each part of a transformer layer.

A transformer layer is ``x + drop(self_attention(input_norm(x)))`` then
``x + drop(mlp(pre_mlp_norm(x)))``. :class:`LayerSpec` names the module behind each part as a
factory ``(config, state, layer_number) -> nn.Module`` (``layer_number`` global, 1-based), so a
variant is a different spec, not a change to the layer:

* a new attention variant (ring attention over a context-parallel group, a fused kernel):
  ``core_attention`` - gets ``q, k, v [s, b, heads, d]``, returns ``[s, b, heads * d]``;
* a new MLP or a mixture of experts: ``mlp`` - gets and returns ``[s(/tp), b, h]``;
* a different attention block altogether (cross-attention, latent attention): ``self_attention``,
  called as ``factory(config, state, layer_number, core_attention=spec.core_attention)``;
* norms: ``input_norm`` / ``pre_mlp_norm``.

A model passes either one spec for every layer or a function ``layer_number -> LayerSpec`` (for
example a mixture of experts in every other layer). GEMM precision is not part of the spec: every
parallel linear asks ``config.make_gemm`` (see :class:`~megatron_lite.models.transformer_config.TransformerConfig`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..moe.config import moe_layer_pattern
from ..moe.layer import MoELayer
from ..parallel.context import ContextParallelAttention
from .attention import DotProductAttention, SelfAttention
from .common import Norm
from .mla import MLASelfAttention
from .mlp import MLP

Factory = Callable[..., nn.Module]


@dataclass(frozen=True)
class LayerSpec:
    input_norm: Factory = Norm.from_config
    self_attention: Factory = SelfAttention
    core_attention: Factory = DotProductAttention
    pre_mlp_norm: Factory = Norm.from_config
    mlp: Factory = MLP


def resolve_spec(spec, layer_number: int) -> LayerSpec:
    """The spec of global layer ``layer_number`` from one spec or a per-layer function."""
    return spec if isinstance(spec, LayerSpec) else spec(layer_number)


def gpt_layer_spec(config) -> LayerSpec | Callable[[int], LayerSpec]:
    """GPT's layers: pre-norm self-attention with dot-product core attention and the dense MLP, or
    the MoE layer in the layers ``--moe-layer-freq`` selects when the model has experts. Under
    context parallelism the core attention is the context-parallel one (ring / a2a / allgather);
    with ``--multi-latent-attention`` the attention block is MLA (:mod:`~megatron_lite.models.mla`).
    With ``--spec MODULE NAME`` (``config.spec``, saved with checkpoints) the user's spec instead, so
    every tool that builds a model from a config builds that one (:mod:`~megatron_lite.models.spec_plugin`)."""
    if getattr(config, "spec", None):
        from .spec_plugin import load_spec  # it imports this module

        return load_spec(*config.spec)
    attention = {"core_attention": ContextParallelAttention} if getattr(config, "context_parallel_size", 1) > 1 else {}
    if getattr(config, "multi_latent_attention", False):
        attention["self_attention"] = MLASelfAttention
    if not config.num_experts:
        return LayerSpec(**attention)
    pattern = moe_layer_pattern(config)
    dense, moe = LayerSpec(**attention), LayerSpec(mlp=MoELayer, **attention)
    return lambda layer_number: moe if pattern[layer_number - 1] else dense


def bert_layer_spec(config) -> LayerSpec | Callable[[int], LayerSpec]:
    """BERT's layers (Megatron's BERT is pre-LayerNorm like GPT): the same parts as GPT's, experts
    included; the bidirectional padding mask is the block's ``attn_mask_type``, not a different module."""
    return gpt_layer_spec(config)
