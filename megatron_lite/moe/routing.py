"""Pure routing functions: top-k with each score function, group-limited top-k, Sinkhorn, capacity.

Everything here works on the router logits of the local tokens, ``[T, E]`` (token order s-major:
token ``t = s * B + b`` of an ``[s, b, h]`` activation), and returns

* ``routing_probs [T, E]``: the weight of each selected expert, zero elsewhere;
* ``routing_map [T, E]`` (bool): which experts each token is sent to.

No communication happens here; the router module adds the losses and the bookkeeping.
"""

from __future__ import annotations

import math

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim computed in fp32, returned in the input dtype."""
    return torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Top-k restricted to the best ``group_topk`` of ``num_groups`` expert groups.

    A group's score is the sum of its best ``topk // group_topk`` expert scores; experts of the
    groups not kept are masked to -inf before the final top-k. Returns ``(values, indices)``.
    """
    tokens, experts = scores.shape
    per_group = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    kept_groups = group_scores.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(tokens, experts)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def _select(scores, topk, num_groups, group_topk):
    if num_groups:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, expert_bias: torch.Tensor | None = None):
    """Select ``topk`` experts per token and their weights.

    * softmax, post (default): top-k of the raw logits, weights = softmax over the k selected;
    * softmax, pre: softmax over all experts, then top-k; weights are not renormalised;
    * sigmoid: ``s = sigmoid(logits)``; selection on ``s + expert_bias`` when the bias is given,
      weights = ``s`` at the selection, normalised to sum 1 when k > 1.

    ``scaling_factor`` multiplies the selected weights. Returns ``(routing_probs, routing_map)``.
    """
    if score_function == "softmax":
        if pre_softmax:
            probs, indices = _select(_softmax(logits), topk, num_groups, group_topk)
        else:
            values, indices = _select(logits, topk, num_groups, group_topk)
            probs = _softmax(values)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, indices = _select(scores + expert_bias, topk, num_groups, group_topk)
            probs = scores.gather(1, indices)
        else:
            probs, indices = _select(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score function {score_function!r} is not one of {SCORE_FUNCTIONS}")
    if scaling_factor:
        probs = probs * scaling_factor
    return _scatter(logits, indices, probs)


def _scatter(logits, indices, probs):
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_probs, routing_map


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4, max_iters: int = 1000) -> torch.Tensor:
    """Balance ``exp(cost)`` towards uniform row and column sums by alternating rescaling."""
    k = torch.exp(cost)
    rows, cols = k.shape
    row_scale = torch.ones(rows, dtype=k.dtype, device=k.device)
    col_scale = torch.ones(cols, dtype=k.dtype, device=k.device)
    for _ in range(max_iters):
        row_scale = 1.0 / (rows * ((k * col_scale).sum(dim=1) + 1e-8))
        new_col = 1.0 / (cols * ((k * row_scale.unsqueeze(1)).sum(dim=0) + 1e-8))
        change = (new_col - col_scale).abs().mean()
        col_scale = new_col
        if change <= tol:
            break
    return k * col_scale * row_scale.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool):
    """Sinkhorn load balancing: in training the experts are the top-k of the balanced scores and the
    weights are ``sigmoid`` (k = 1) or ``softmax`` (k > 1) of the logits at those experts; in
    evaluation the top-k of the activated logits is used directly."""
    activation = torch.sigmoid if topk == 1 else _softmax
    if training:
        with torch.no_grad():
            _, indices = torch.topk(sinkhorn(logits.float()), topk, dim=-1)
        probs = activation(logits).gather(1, indices)
    else:
        probs, indices = torch.topk(activation(logits), topk, dim=-1)
    return _scatter(logits, indices, probs)


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: str):
    """The scores and plain top-k map the load-balancing losses use.

    They are recomputed from the logits over all experts (softmax, or sigmoid normalised to sum
    1) and ignore group limits, expert bias and capacity, so the loss measures the router itself.
    """
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = torch.topk(scores, topk, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)
    return scores, routing_map


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Slots per expert on this rank: ``ceil(T * k / E * capacity_factor)``, at most ``T``."""
    return min(num_tokens, math.ceil(num_tokens * topk / num_experts * capacity_factor))


def drop_to_capacity(routing_probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, *,
                     policy: str = "probs", pad_to_capacity: bool = False):
    """Keep at most ``capacity`` token slots per expert.

    ``probs`` keeps, per expert, the slots with the largest weights; ``position`` keeps the earliest
    routed tokens. Without padding the dropped slots leave the map (a token whose experts were all
    dropped gets no expert output). With ``pad_to_capacity`` every expert gets exactly
    ``capacity`` slots: unused slots are filled with unrouted tokens of weight 0.
    Returns ``(routing_probs, routing_map, num_dropped)``.
    """
    tokens = routing_map.shape[0]
    # unrouted slots rank below every routed one, earlier tokens first (they only fill padding)
    position = torch.arange(tokens, device=routing_map.device, dtype=torch.float64).unsqueeze(1) / tokens
    if policy == "probs":
        key = torch.where(routing_map, routing_probs.detach().double(), -1.0 - position)
    elif policy == "position":  # routed tokens first, earlier tokens first
        key = routing_map.double() * 2 - position
    else:
        raise ValueError(f"token drop policy {policy!r} is not one of {DROP_POLICIES}")
    kept = torch.topk(key, capacity, dim=0, sorted=False).indices
    keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    new_map = keep if pad_to_capacity else routing_map & keep
    num_dropped = int((routing_map & ~keep).sum())
    return routing_probs * new_map, new_map, num_dropped


def pad_routing_map(routing_map: torch.Tensor, multiple: int) -> torch.Tensor:
    """``--moe-router-padding-for-fp8``: the map with each expert's column count raised to a multiple
    of ``multiple`` by adding the earliest tokens not yet routed to it (a rank with too few tokens
    gives an expert all of them). The added slots are padding: the dispatcher routes them with weight
    0 and zero rows (:func:`megatron_lite.moe.dispatcher.permute_padded`)."""
    counts = routing_map.sum(dim=0)
    missing = (-counts) % multiple
    free = ~routing_map
    rank_among_free = free.long().cumsum(dim=0)  # 1 for an expert's first unrouted token, 2 for its next, ...
    return routing_map | (free & (rank_among_free <= missing.unsqueeze(0)))
