"""Transformer models built from the tensor-parallel layers, assembled through layer specs."""

from .attention import DotProductAttention, SelfAttention
from .gpt import GPTModel
from .mlp import MLP
from .spec import LayerSpec, gpt_layer_spec
from .transformer import TransformerBlock, TransformerLayer
from .transformer_config import TransformerConfig

__all__ = [
    "MLP", "DotProductAttention", "GPTModel", "LayerSpec", "SelfAttention", "TransformerBlock", "TransformerConfig",
    "TransformerLayer", "gpt_layer_spec",
]
