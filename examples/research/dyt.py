"""A normalization of one's own: Dynamic Tanh (DyT, Zhu et al. 2025), ``weight * tanh(alpha * x) + bias``
in place of every LayerNorm / RMSNorm of the model (the two in each layer and the final one).

    python pretrain_gpt.py --spec examples/research/dyt.py spec ...

A norm is a layer-spec factory ``(config, state, layer_number) -> nn.Module`` mapping ``[s(/tp), b, h]``
to the same shape: ``input_norm`` and ``pre_mlp_norm`` of each layer, and ``final_norm`` (read from the
last layer's spec). Its parameters are replicated over the tensor-parallel ranks; under
``--sequence-parallel`` each rank sees only its shard of the sequence, so every one of them is
marked ``param.sequence_parallel = config.sequence_parallel`` and the training code sums their
gradients over the TP group, as it does for the stock norms. Unmarked, TP2 + SP trains a different
model from one process. DyT reads no statistics of its input, so nothing needs communicating.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.models.spec import LayerSpec

ALPHA = 0.5  # the paper's initial alpha


class DyT(nn.Module):
    """``weight * tanh(alpha * x) + bias`` over the hidden dim; ``alpha`` one learned scalar."""

    def __init__(self, config, state=None, layer_number: int | None = None, alpha: float = ALPHA):
        super().__init__()
        h, dtype = config.hidden_size, config.params_dtype
        self.alpha = nn.Parameter(torch.full((1,), alpha, dtype=dtype))
        self.weight = nn.Parameter(torch.ones(h, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(h, dtype=dtype))
        for param in (self.alpha, self.weight, self.bias):  # replicated over TP, fed this rank's tokens under SP
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.tanh(self.alpha * x) + self.bias


spec = LayerSpec(input_norm=DyT, pre_mlp_norm=DyT, final_norm=DyT)
