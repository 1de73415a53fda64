"""The top-k router of an MoE layer: gating GEMM, routing, capacity, auxiliary losses.

``TopKRouter(config, state, layer_number)(hidden [s, b, h]) -> (routing_probs [T, E], routing_map [T, E])``
with ``T = s * b`` local tokens. The router weight ``[E, h]`` (and, with biases on, i.e. without
``--disable-bias-linear``, its bias ``[E]`` added to the logits, zero-initialised, as in Megatron-LM) is
replicated; under sequence parallelism each tensor-parallel rank routes only its sequence shard, so
they are marked ``sequence_parallel`` (their gradients are summed over the tensor-parallel group).

Auxiliary losses are attached to the autograd graph (z-loss to the logits, load-balancing losses
to the routing probabilities) with the gradient ``aux_loss_backward_scale``, which the training
loop sets on every router (:func:`megatron_lite.moe.metrics.set_aux_loss_backward_scale`). The
un-coefficiented values are summed per micro-batch into ``metrics`` for logging, and
``num_dropped_tokens`` counts slots dropped by the capacity limit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import comm
from .aux_loss import LOSS_NAMES, attach_loss, switch_loss, z_loss
from .routing import aux_loss_scores, drop_to_capacity, expert_capacity, sinkhorn_routing, topk_routing

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def balancing_types(config) -> list[tuple[str, float]]:
    """``(load-balancing type, coefficient)`` pairs from the (possibly list-valued) flags."""
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    types = [types] if isinstance(types, str) else list(types)
    coeffs = [coeffs] * len(types) if isinstance(coeffs, (int, float)) else list(coeffs)
    return list(zip(types, coeffs))


def init_replicated(param: nn.Parameter, init_method) -> None:
    """Fill a replicated parameter from its full fp32 master weight (drawn by ``init_method``)."""
    master = torch.empty(param.shape, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        param.copy_(master)


def _sum_over(x: torch.Tensor, *groups) -> torch.Tensor:
    """Sum ``x`` over each group in turn (no gradient: token counts)."""
    with torch.no_grad():
        for group in groups:
            x = comm.reduce_from_tp(x, group)
    return x


class TopKRouter(nn.Module):
    def __init__(self, config, state, layer_number: int):
        super().__init__()
        self.config, self.state, self.layer_number = config, state, layer_number
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.balancing = balancing_types(config)
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=config.params_dtype))
        init_replicated(self.weight, config.init_method(layer_number, "mlp.router.weight"))
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.bias = None
        if getattr(config, "add_bias_linear", False):
            self.bias = nn.Parameter(torch.zeros(config.num_experts, dtype=config.params_dtype))
            self.bias.sequence_parallel = bool(config.sequence_parallel)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_experts), persistent=False)
        else:
            self.expert_bias = None
        self.register_buffer("global_tokens_per_expert", torch.zeros(config.num_experts), persistent=False)
        self.global_steps = 0
        self.aux_loss_backward_scale = 1.0
        self.metrics: dict[str, torch.Tensor] = {}
        self.num_dropped_tokens = 0

    # ------------------------------------------------------------------------------------------
    def gating(self, hidden: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, E]`` in the router dtype (the input dtype unless --moe-router-dtype)."""
        eps = self.config.moe_input_jitter_eps
        if self.training and eps:
            hidden = hidden * torch.empty_like(hidden).uniform_(1.0 - eps, 1.0 + eps)
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype, hidden.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(hidden.to(dtype), self.weight.to(dtype), bias).view(-1, self.num_experts)

    def route(self, logits: torch.Tensor):
        c = self.config
        if any(kind == "sinkhorn" for kind, _ in self.balancing):
            return sinkhorn_routing(logits, self.topk, self.training)
        return topk_routing(
            logits, self.topk, score_function=c.moe_router_score_function, pre_softmax=c.moe_router_pre_softmax,
            num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk,
            scaling_factor=c.moe_router_topk_scaling_factor, expert_bias=self.expert_bias,
        )

    def forward(self, hidden: torch.Tensor):
        c = self.config
        logits = self.gating(hidden)
        grad = self.training and torch.is_grad_enabled()
        if grad and c.moe_z_loss_coeff:
            loss = z_loss(logits, c.moe_z_loss_coeff, comm.group_size(self.state.group("tp_cp")))
            logits = self._attach(logits, loss)
            self._track("z_loss", loss / c.moe_z_loss_coeff)
        probs, routing_map = self.route(logits)
        if grad and self.expert_bias is not None:  # the router's choice, before the capacity limit
            self.local_tokens_per_expert += routing_map.sum(dim=0).to(self.local_tokens_per_expert.dtype)
        if c.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(logits.shape[0], self.num_experts, self.topk, c.moe_expert_capacity_factor)
            probs, routing_map, dropped = drop_to_capacity(
                probs, routing_map, capacity, policy=c.moe_token_drop_policy,
                pad_to_capacity=c.moe_pad_expert_input_to_capacity)
            if grad:  # once per training forward (not in evaluation, nor twice under recomputation)
                self.num_dropped_tokens += dropped
        if grad:
            probs = self._attach_balancing_losses(logits, probs, hidden.shape[0])
        return probs, routing_map

    # ------------------------------------------------------------------------------------------
    def _attach_balancing_losses(self, logits, probs, seq_local: int):
        active = [(kind, coeff) for kind, coeff in self.balancing if kind in LOSS_NAMES and coeff]
        if not active:
            return probs
        scores, aux_map = aux_loss_scores(logits, self.topk, self.config.moe_router_score_function)
        for kind, coeff in active:
            loss = getattr(self, f"_{kind}")(scores, aux_map, coeff, seq_local)
            probs = self._attach(probs, loss)
            self._track(LOSS_NAMES[kind], loss / coeff)
        return probs

    def _attach(self, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """``activation [T_local, E]`` with ``loss`` attached. With --calculate-per-token-loss the training
        step divides every gradient by the global batch's token count instead of by the micro-batches,
        so the loss is first multiplied by the micro-batch's tokens over TP x CP (``T_local x |TP x CP|``):
        its gradient then has the weight it has without the flag (Megatron-LM multiplies by ``T_local``,
        and by ``T_local x |TP x CP|`` since its TP/CP fix)."""
        if self.config.calculate_per_token_loss:
            loss = loss * (activation.shape[0] * comm.group_size(self.state.group("tp_cp")))
        return attach_loss(activation, loss, self.aux_loss_backward_scale)

    def _aux_loss(self, scores, aux_map, coeff, seq_local):
        group = self.state.group("tp_cp")
        counts = _sum_over(aux_map.sum(dim=0).float(), group)
        total = scores.shape[0] * comm.group_size(group)
        return switch_loss(scores, counts, total, self.topk, self.num_experts, coeff)

    def _seq_aux_loss(self, scores, aux_map, coeff, seq_local):
        """Per sequence: each (sequence, expert) pair is a bin; the mean over the b sequences."""
        group = self.state.group("tp_cp")
        batch = scores.shape[0] // seq_local
        seq_scores = scores.reshape(seq_local, batch * self.num_experts)
        counts = _sum_over(aux_map.reshape(seq_local, -1).sum(dim=0).float(), group)
        total = seq_local * comm.group_size(group)
        return switch_loss(seq_scores, counts, total, self.topk, self.num_experts, coeff) / batch

    def _global_aux_loss(self, scores, aux_map, coeff, seq_local):
        """Counts over the whole data-parallel batch, averaged over this iteration's micro-batches."""
        groups = (self.state.tp_group, self.state.dp_cp_group)
        counts = _sum_over(aux_map.sum(dim=0).float(), *groups)
        self.global_tokens_per_expert += counts
        self.global_steps += 1
        total = scores.shape[0] * comm.group_size(groups[0]) * comm.group_size(groups[1])
        mean_counts = self.global_tokens_per_expert / self.global_steps
        return switch_loss(scores, mean_counts, total, self.topk, self.num_experts, coeff)

    def _track(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.metrics[name] = self.metrics[name] + value if name in self.metrics else value

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def finish_step(self) -> None:
        """After an optimizer step: update the expert bias from the step's token counts (summed over
        TP x DP x CP: ``bias += rate * sign(mean count - count)``) and reset the per-step counters.
        The counts are the router's selection before the capacity limit: after it, dropping caps every
        busy expert at the capacity and padding gives every expert exactly the capacity, hiding the
        imbalance the bias corrects (Megatron-LM counts after it, so its bias never moves with padding)."""
        if self.expert_bias is not None:
            counts = _sum_over(self.local_tokens_per_expert.clone(), self.state.tp_group, self.state.dp_cp_group)
            rate = self.config.moe_router_bias_update_rate
            self.expert_bias += rate * torch.sign(counts.mean() - counts)
            self.local_tokens_per_expert.zero_()
        self.global_tokens_per_expert.zero_()
        self.global_steps = 0
