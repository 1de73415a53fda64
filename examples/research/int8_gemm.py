"""Fake-quantised int8 GEMMs through the GEMM seam: every linear layer of attention and MLP computes
``dequant(quant(x)) @ dequant(quant(W))^T + b``.

    python pretrain_gpt.py --spec examples/research/int8_gemm.py spec ...

The tensor-parallel linears compute their local product with ``self.gemm(x, weight, bias)``
(:mod:`megatron_lite.parallel.tensor`); this module swaps that function on the linears of the
stock attention and MLP, through the layer spec. Quantisation is symmetric int8 (-127..127) with one
scale per row and block of ``BLOCK`` consecutive input features (``scale = amax / 127``), for the
activations (per token) and the weights (per output feature). Blocks never straddle a
tensor-parallel shard (the shard sizes are multiples of ``BLOCK``), so every rank quantises exactly
the numbers one process would: no scale needs communicating. Backward is straight-through: the
gradients are those of the plain GEMM on the quantised operands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lite.errors import ConfigError
from megatron_lite.models.attention import SelfAttention
from megatron_lite.models.mlp import MLP
from megatron_lite.models.spec import LayerSpec
from megatron_lite.parallel.tensor import DEFAULT_GEMMS, ColumnParallelLinear, RowParallelLinear

BLOCK = 16


def fake_quantize(t: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``t`` rounded to int8 with one scale per row and block of ``block`` columns, back in t's dtype;
    the gradient passes straight through."""
    if t.shape[-1] % block:
        raise ValueError(f"int8 example: {t.shape[-1]} input features are not a multiple of BLOCK {block}")
    blocks = t.reshape(*t.shape[:-1], t.shape[-1] // block, block)
    scale = blocks.detach().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.clamp(torch.round(blocks.detach() / scale), -127, 127) * scale
    return t + (q.reshape(t.shape) - t).detach()


def int8_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM seam's signature: ``x @ weight^T + bias`` on fake-quantised operands."""
    return F.linear(fake_quantize(x), fake_quantize(weight), bias)


def with_int8_gemms(factory):
    """A spec factory building ``factory``'s module with every parallel linear's GEMM set to int8_gemm."""

    def build(config, state, layer_number: int, **kwargs):
        module = factory(config, state, layer_number, **kwargs)
        for linear in module.modules():
            if isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                if linear.gemm not in DEFAULT_GEMMS:
                    raise ConfigError("int8 example: this layer already has a precision recipe's GEMM "
                                     "(--fp8-format / --transformer-impl); drop it")
                linear.gemm = int8_gemm
        return module

    build.__wrapped__ = factory  # --spec's flag checks see the class it builds (e.g. SelfAttention for --qk-layernorm)
    return build


spec = LayerSpec(self_attention=with_int8_gemms(SelfAttention), mlp=with_int8_gemms(MLP))
