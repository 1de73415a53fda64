"""The MLP: fc1 (ColumnParallelLinear) -> GeLU or SwiGLU -> fc2 (RowParallelLinear).

SwiGLU fuses the gate and up projections into one fc1 of ``2 * ffn`` rows, master layout
``[gate; up]``. The weight is split with partition stride 2, so each TP rank holds its slice of
the gate *and* its matching slice of up, and ``silu(gate) * up`` stays local to the rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear
from .common import seeded_init


class MLP(nn.Module):
    def __init__(self, config, state, layer_number: int, *, seed: int, sequence_parallel: bool = False,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.swiglu = config.swiglu
        ffn = config.ffn_hidden_size or 4 * config.hidden_size
        bias = not config.disable_bias_linear
        std = config.init_method_std
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, 2 * ffn if self.swiglu else ffn, state.tp_group, bias=bias,
            init_method=seeded_init(seed, layer_number, "mlp.linear_fc1.weight", std),
            sequence_parallel=sequence_parallel, stride=2 if self.swiglu else 1, dtype=params_dtype, device=device,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn, config.hidden_size, state.tp_group, bias=bias, input_is_parallel=True,
            init_method=seeded_init(seed, layer_number, "mlp.linear_fc2.weight", std, config.num_layers),
            sequence_parallel=sequence_parallel, dtype=params_dtype, device=device,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.linear_fc1(hidden)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x)
        return self.linear_fc2(x)
