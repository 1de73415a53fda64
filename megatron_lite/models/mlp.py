"""The MLP: fc1 (ColumnParallelLinear) -> GeLU or SwiGLU -> fc2 (RowParallelLinear).

GeLU is the exact (erf) form, or with ``--openai-gelu`` the tanh approximation GPT-2 was trained with.
With bias + activation fusion (``--bias-gelu-fusion`` / ``--bias-swiglu-fusion``, Megatron's CLI
defaults) fc1 leaves its bias to :mod:`megatron_lite.fusions.activations`, whose GeLU is always the
tanh approximation (as Megatron's). With bias + dropout fusion fc2 returns ``(output, bias)`` and the
transformer layer adds the bias with the dropout and the residual.

SwiGLU fuses the gate and up projections into one fc1 of ``2 * ffn`` rows, master layout
``[gate; up]``. The weight is split with partition stride 2, so each TP rank holds its slice of
the gate *and* its matching slice of up, and ``silu(gate) * up`` stays local to the rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..fusions.activations import bias_gelu_impl, bias_swiglu_impl
from .common import column_linear, row_linear


class MLP(nn.Module):
    """``forward(hidden [s(/tp), b, h]) -> [s(/tp), b, h]`` (the layer spec's ``mlp`` contract), or
    ``(output, fc2 bias)`` with ``config.bias_dropout_fusion``."""

    def __init__(self, config, state, layer_number: int):
        super().__init__()
        self.swiglu = config.swiglu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        self.fused_activation = config.bias_activation_fusion
        ffn = config.ffn_hidden_size
        self.linear_fc1 = column_linear(config, state, layer_number, 2 * ffn if self.swiglu else ffn, "mlp.linear_fc1",
                                        stride=2 if self.swiglu else 1, skip_bias_add=self.fused_activation)
        self.linear_fc2 = row_linear(config, state, layer_number, ffn, "mlp.linear_fc2",
                                     skip_bias_add=config.bias_dropout_fusion)

    def forward(self, hidden: torch.Tensor):
        if self.fused_activation:
            x, bias = self.linear_fc1(hidden)
            x = bias_swiglu_impl(x, bias) if self.swiglu else bias_gelu_impl(x, bias)
            return self.linear_fc2(x)
        x = self.linear_fc1(hidden)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x, approximate=self.gelu_approximate)
        return self.linear_fc2(x)
