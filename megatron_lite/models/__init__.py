"""Transformer models built from the tensor-parallel layers (GPT; the block is reusable for BERT)."""

from .gpt import GPTModel, tensor_parallel_meta
from .transformer import TransformerBlock, TransformerLayer

__all__ = ["GPTModel", "TransformerBlock", "TransformerLayer", "tensor_parallel_meta"]
