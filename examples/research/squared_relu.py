"""A custom MLP: squared ReLU (Primer, So et al. 2021), ``fc2(relu(fc1(x))^2)``.

    python pretrain_gpt.py --spec examples/research/squared_relu.py spec ...

The module is built from the same tensor-parallel pieces as the stock MLP
(:func:`~megatron_lite.models.common.column_linear` splits fc1's output features over the TP ranks,
:func:`~megatron_lite.models.common.row_linear` sums fc2's partial products), so the activation is
elementwise on each rank's slice and the model is the same at every tensor-parallel size. The
parameter names (``linear_fc1``, ``linear_fc2``) and seeds are the stock MLP's: the weights start
identical and checkpoints convert like any GPT's.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.models.common import column_linear, row_linear
from megatron_lite.models.spec import LayerSpec


class SquaredReLUMLP(nn.Module):
    """``[s(/tp), b, h] -> [s(/tp), b, h]``: the layer spec's ``mlp`` contract."""

    def __init__(self, config, state, layer_number: int):
        super().__init__()
        ffn = config.ffn_hidden_size
        self.linear_fc1 = column_linear(config, state, layer_number, ffn, "mlp.linear_fc1")
        # with bias + dropout fusion fc2 returns (output, bias): the layer adds the bias in its fused residual
        self.linear_fc2 = row_linear(config, state, layer_number, ffn, "mlp.linear_fc2",
                                     skip_bias_add=config.bias_dropout_fusion)

    def forward(self, hidden: torch.Tensor):
        return self.linear_fc2(torch.relu(self.linear_fc1(hidden)).square())


spec = LayerSpec(mlp=SquaredReLUMLP)
