"""Auxiliary router losses and how they reach the gradient.

An auxiliary loss is not added to the language-model loss. :func:`attach_loss` ties it to an
activation of the router instead: the forward returns the activation unchanged; the backward
passes the activation's gradient through and gives the loss the gradient ``scale`` (the factor
the training loop applies to the main loss before its backward: loss scale / number of
micro-batches, times the context-parallel size). The loss therefore trains the router exactly as
if ``scale * loss`` had been added to the backward loss, whatever the rest of the graph does.

The load-balancing loss (Switch Transformer form, normalised by top-k) over a token set of T
tokens is ``coeff * E * sum_i f_i * P_i`` with ``f_i`` the fraction of routed slots on expert i and
``P_i`` the mean router score of expert i; it is ``coeff`` for a perfectly balanced router. Each
rank only holds a shard of the tokens (sequence parallelism), so it computes the partial
``coeff * E / (k * T^2) * sum_i p_i * c_i`` with ``p_i`` its own score sums and ``c_i`` the
token counts summed over the shards; the partials sum to the loss over the whole token set.
"""

from __future__ import annotations

import torch

LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, loss, scale):
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach_loss(activation: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``activation`` unchanged; in backward ``loss`` receives the gradient ``scale``."""
    return _AttachLoss.apply(activation, loss, float(scale))


def switch_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int, topk: int,
                num_experts: int, coeff: float) -> torch.Tensor:
    """This rank's partial load-balancing loss ``coeff * E / (k * T^2) * sum_i p_i * c_i``.

    ``scores [T_local, E']`` are this rank's router scores (``p_i`` = their column sums),
    ``tokens_per_expert [E']`` the routed counts over the whole token set of ``total_tokens``.
    """
    per_expert = scores.sum(dim=0)
    return coeff * num_experts / (topk * total_tokens * total_tokens) * (per_expert * tokens_per_expert).sum()


def z_loss(logits: torch.Tensor, coeff: float, num_shards: int = 1) -> torch.Tensor:
    """ST-MoE router z-loss ``coeff * mean_t(logsumexp(logits_t)^2)``, divided over ``num_shards``
    ranks that each hold an equal share of the tokens (their partials sum to the loss)."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    return coeff / num_shards * lse.square().mean()
