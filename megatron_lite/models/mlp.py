"""The MLP: fc1 (ColumnParallelLinear) -> GeLU or SwiGLU -> fc2 (RowParallelLinear).

SwiGLU fuses the gate and up projections into one fc1 of ``2 * ffn`` rows, master layout
``[gate; up]``. The weight is split with partition stride 2, so each TP rank holds its slice of
the gate *and* its matching slice of up, and ``silu(gate) * up`` stays local to the rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import column_linear, row_linear


class MLP(nn.Module):
    """``forward(hidden [s(/tp), b, h]) -> [s(/tp), b, h]`` (the layer spec's ``mlp`` contract)."""

    def __init__(self, config, state, layer_number: int):
        super().__init__()
        self.swiglu = config.swiglu
        ffn = config.ffn_hidden_size
        self.linear_fc1 = column_linear(config, state, layer_number, 2 * ffn if self.swiglu else ffn, "mlp.linear_fc1",
                                        stride=2 if self.swiglu else 1)
        self.linear_fc2 = row_linear(config, state, layer_number, ffn, "mlp.linear_fc2")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.linear_fc1(hidden)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x)
        return self.linear_fc2(x)
