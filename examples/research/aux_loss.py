"""An auxiliary loss from inside the model: an L1 penalty on the MLP's hidden activations
(activation sparsity, as in ProSparse / "ReLU strikes back"), added to the training objective as
``lm loss + COEFF * mean |gelu(fc1(x))|`` per MLP layer.

    python pretrain_gpt.py --spec examples/research/aux_loss.py spec ...

The loss never joins the language-model loss tensor: :func:`~megatron_lite.moe.aux_loss.attach_loss`
ties it to the activation, and its backward gives the loss the gradient ``aux_loss_backward_scale``,
which the training loop sets every step on every module that has that attribute (the factor it
applies to the main loss: loss scale / micro-batches, times the context-parallel size), exactly as
for the MoE routers' load-balancing loss. So the gradient is the one of ``lm loss + aux`` under
every schedule, micro-batch count and loss scale. Each rank holds a slice of the hidden units
(``[s / cp, b, ffn / tp]``: its heads' share of fc1 under tensor parallelism, its part of the
sequence under context parallelism): its partial mean, divided by TP x CP, only depends on its
slice, and the partials of the TP x CP ranks sum to the mean over all units (as the routers' losses,
whose partials sum over the same group). With ``--calculate-per-token-loss`` the main loss is a sum
over tokens and the loop divides every gradient by the batch's token count, so the penalty is
first multiplied by the micro-batch's tokens, as the routers do (``config.calculate_per_token_loss``).

The penalty is logged like the routers' losses: the module adds this rank's partial of each
micro-batch to ``aux_losses["l1_penalty"]``, and the loop (``plugin_loss_values`` in
megatron_lite/moe/metrics.py) puts its mean over the micro-batches and the layers, summed over the
TP x CP partials, on the console line and in TensorBoard after ``lm loss``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.models.common import column_linear, row_linear
from megatron_lite.models.spec import LayerSpec
from megatron_lite.moe.aux_loss import attach_loss

COEFF = 1e-2


class L1PenaltyMLP(nn.Module):
    """fc1 -> GeLU (tanh form) -> fc2 like the stock MLP, plus ``COEFF * mean |hidden units|`` as an auxiliary loss."""

    def __init__(self, config, state, layer_number: int, coeff: float = COEFF):
        super().__init__()
        ffn = config.ffn_hidden_size
        self.linear_fc1 = column_linear(config, state, layer_number, ffn, "mlp.linear_fc1")
        self.linear_fc2 = row_linear(config, state, layer_number, ffn, "mlp.linear_fc2",
                                     skip_bias_add=config.bias_dropout_fusion)
        self.coeff, self.tp_size, self.cp_size = coeff, state.tp_size, state.cp_size
        self.per_token = config.calculate_per_token_loss
        self.aux_loss_backward_scale = 1.0  # set by the training loop before every step
        self.aux_losses = {}  # name -> this rank's partials summed over the step's micro-batches (the loop logs them)

    def forward(self, hidden: torch.Tensor):
        units = F.gelu(self.linear_fc1(hidden), approximate="tanh")  # [s / cp, b, ffn / tp]
        if self.training and self.coeff and torch.is_grad_enabled():
            loss = self.coeff * units.abs().mean() / (self.tp_size * self.cp_size)  # this rank's partial
            self.aux_losses["l1_penalty"] = self.aux_losses.get("l1_penalty", 0.0) + loss.detach()
            if self.per_token:  # the main loss sums its tokens: weigh the penalty by the micro-batch's tokens
                loss = loss * (units.shape[0] * units.shape[1] * self.cp_size)
            units = attach_loss(units, loss, self.aux_loss_backward_scale)
        return self.linear_fc2(units)


spec = LayerSpec(mlp=L1PenaltyMLP)
