"""The MLP: fc1 (ColumnParallelLinear) -> activation -> fc2 (RowParallelLinear).

The activation (:mod:`megatron_lite.activations`) is GeLU, SwiGLU (``--swiglu``), squared
ReLU (``--squared-relu``) or quick-GeGLU (``--quick-geglu``). GeLU is the exact (erf) form, or with
``--openai-gelu`` the tanh approximation GPT-2 was trained with. With bias + activation fusion
(``--bias-gelu-fusion`` / ``--bias-swiglu-fusion``, Megatron's CLI defaults) fc1 leaves its bias to
:mod:`megatron_lite.fusions.activations`, whose GeLU is always the tanh approximation (as Megatron's);
the fusion covers plain GeLU and SwiGLU only (the other activations, and a gated unit with
``--glu-linear-offset`` or ``--activation-func-clamp-value``, run unfused: the same numbers). With
bias + dropout fusion fc2 returns ``(output, bias)`` and the transformer layer adds the bias with the
dropout and the residual.

A gated unit (SwiGLU, quick-GeGLU) fuses the gate and linear projections into one fc1 of ``2 * ffn``
rows, master layout ``[gate; linear]``. The weight is split with partition stride 2, so each TP rank
holds its slice of the gate *and* its matching slice of the linear half, and the product stays local
to the rank.
"""

from __future__ import annotations

from torch import nn

from ..activations import MLPActivation
from ..fusions.activations import bias_activation_impl
from .common import column_linear, row_linear


class MLP(nn.Module):
    """``forward(hidden [s(/tp), b, h]) -> [s(/tp), b, h]`` (the layer spec's ``mlp`` contract), or
    ``(output, fc2 bias)`` with ``config.bias_dropout_fusion``."""

    def __init__(self, config, state, layer_number: int):
        super().__init__()
        self.activation = MLPActivation(config, "tanh" if config.openai_gelu else "none")
        self.swiglu = config.swiglu
        self.fused_activation = config.bias_activation_fusion and self.activation.plain
        ffn, gated = config.ffn_hidden_size, self.activation.gate
        self.linear_fc1 = column_linear(config, state, layer_number, 2 * ffn if gated else ffn, "mlp.linear_fc1",
                                        stride=2 if gated else 1, skip_bias_add=self.fused_activation)
        self.linear_fc2 = row_linear(config, state, layer_number, ffn, "mlp.linear_fc2",
                                     skip_bias_add=config.bias_dropout_fusion)

    def forward(self, hidden):
        if self.fused_activation:
            x, bias = self.linear_fc1(hidden)
            x = bias_activation_impl(x, bias, self.swiglu)
            return self.linear_fc2(x)
        return self.linear_fc2(self.activation(self.linear_fc1(hidden)))
