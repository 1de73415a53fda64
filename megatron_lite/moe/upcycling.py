"""MoE upcycling (``--moe-use-upcycling``): the experts of an MoE model made from a dense model's MLPs.

The rule (Megatron-LM's, from He et al. 2024, "Upcycling Large Language Models into Mixture of
Experts", arXiv 2410.07524). With granularity ``G`` (``--moe-upcycling-granularity``) the dense MLP's
FFN dimension ``F`` is cut into ``G`` slices of ``F / G`` (fc1's rows, for a gated unit the same rows of
its gate and linear halves; fc2's columns); the ``E`` experts are ``E / G`` copies of the ``G`` slices,
expert ``e`` holding slice ``e % G``. The sum of the ``G`` slices' outputs is the dense MLP's output
(less its fc2 bias, which every slice holds whole).

The router ("virtual groups" for ``G > 1``): the ``G`` experts ``g*G .. g*G+G-1`` (one whole copy of
the dense MLP) share one router row (the fresh row ``g``), so their logits are equal and a top-k of a
multiple of ``G`` selects whole copies with equal weights.

Scale: every expert's output is multiplied by ``G / m`` (fc2's weight by ``G / m``, fc2's bias by ``1 /
m``), where ``m`` is the total routing weight of a token's selected experts. With the weights
normalised over the selected experts (``--moe-router-score-function softmax`` without
``--moe-router-pre-softmax``, the default; or ``sigmoid`` with ``--moe-router-topk`` > 1) ``m`` is the
``--moe-router-topk-scaling-factor`` (1 when unset) for every token, so the upcycled layer computes
exactly the dense MLP. With ``--moe-router-pre-softmax`` the selected weights sum to about ``k / E``
(uniform scores), so ``m = k / E`` times the scaling factor (Megatron-LM's ``E * G / k``): close to
the dense model at the start, not exact. Megatron-LM spreads the factor over fc1 and fc2 (its cube
root on each for gated or squared-ReLU units, its square root otherwise), which is exact only for
ReLU-like activations; here fc2 alone carries it, exact for every activation.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def upcycling_problem(config) -> str | None:
    """The first flag combination upcycling cannot run, as one line naming the flag and the fix."""
    moe, ck = config.moe, config.checkpoint
    g = moe.moe_upcycling_granularity
    if g is None or g < 1:
        return f"--moe-upcycling-granularity {g} must be a positive integer (1: every expert a whole copy)"
    if not moe.moe_use_upcycling:
        return None if g == 1 else (f"--moe-upcycling-granularity {g} has no effect without --moe-use-upcycling; "
                                    "add it or drop the granularity")
    if not moe.num_experts:
        return "--moe-use-upcycling turns a dense model into experts and needs --num-experts; add it or drop the flag"
    if ck.load is None:
        return "--moe-use-upcycling needs --load (the dense checkpoint to make the experts from)"
    e, k = moe.num_experts, moe.moe_router_topk
    if e % g or k % g:
        return (f"--moe-upcycling-granularity {g} must divide --num-experts {e} and --moe-router-topk {k} "
                "(a token's experts are whole copies of the dense MLP, each G slices)")
    for flag, given in (("--pretrained-checkpoint", ck.pretrained_checkpoint is not None),
                        ("--use-checkpoint-args", ck.use_checkpoint_args),
                        ("--ckpt-step", getattr(ck, "ckpt_step", None) is not None),
                        ("--lora-rank", getattr(getattr(config, "lora", None), "lora_rank", None) is not None),
                        ("--moe-shared-expert-intermediate-size", bool(moe.moe_shared_expert_intermediate_size)),
                        ("--moe-router-load-balancing-type sinkhorn", "sinkhorn" in moe.moe_router_load_balancing_type)):
        if given:
            return f"--moe-use-upcycling does not support {flag}: {_WHY[flag]}; drop one of the two"
    if moe.moe_router_score_function == "sigmoid" and k == 1:
        return ("--moe-use-upcycling with --moe-router-score-function sigmoid needs --moe-router-topk > 1 (a single "
                "expert's weight sigmoid(logit) varies per token, so no scale gives the dense MLP back)")
    groups = moe.moe_router_num_groups
    if groups and (e // groups) % g:
        return (f"--moe-router-num-groups {groups} leaves {e // groups} experts per group, not a multiple of "
                f"--moe-upcycling-granularity {g}; a group must hold whole copies of the dense MLP")
    return None


_WHY = {
    "--pretrained-checkpoint": "the dense checkpoint is read from --load",
    "--use-checkpoint-args": "the dense checkpoint has no MoE flags to take",
    "--ckpt-step": "upcycling reads the dense checkpoint --load's tracker names (save the wanted iteration's "
                   "weights to a folder of their own, or point the tracker at it)",
    "--lora-rank": "adapters are trained on a model that is already MoE (upcycle, then fine-tune its checkpoint)",
    "--moe-shared-expert-intermediate-size": "shared experts would start from scratch and change the dense function",
    "--moe-router-load-balancing-type sinkhorn": "its balanced selection can split the copies of the dense MLP",
}


def check_upcycling_flags(config) -> None:
    problem = upcycling_problem(config)
    if problem:
        raise ConfigError(problem)


def routing_mass(config) -> tuple[float, bool]:
    """(m, exact): the total routing weight of a token's selected experts (see the module docstring),
    and whether it is the same for every token (the upcycled model then equals the dense one)."""
    scale = config.moe_router_topk_scaling_factor or 1.0
    if config.moe_router_pre_softmax:
        return config.moe_router_topk / config.num_experts * scale, False
    return scale, True


def expert_from_dense(dense: dict, expert: int, granularity: int, gated: bool, mass: float) -> dict:
    """Expert ``expert``'s full (single-process) tensors from the dense MLP's: ``dense`` maps
    ``fc1.weight`` ``[F (2F gated), h]``, ``fc2.weight`` ``[h, F]`` and, with biases, ``fc1.bias``,
    ``fc2.bias`` to tensors; the result has the same keys, cut to slice ``expert % granularity`` and scaled."""
    part, g = expert % granularity, granularity
    width = dense["fc2.weight"].shape[1] // g
    rows = slice(part * width, (part + 1) * width)

    def fc1(t):  # a gated unit's master layout is [gate; linear]: the same rows of both halves
        if not gated:
            return t[rows]
        gate, linear = t.chunk(2, dim=0)
        return torch.cat([gate[rows], linear[rows]])

    out = {"fc1.weight": fc1(dense["fc1.weight"]), "fc2.weight": dense["fc2.weight"][:, rows] * (g / mass)}
    if "fc1.bias" in dense:
        out["fc1.bias"] = fc1(dense["fc1.bias"])
    if "fc2.bias" in dense:
        out["fc2.bias"] = dense["fc2.bias"] / mass
    return {k: v.clone() for k, v in out.items()}


def share_router_rows(weight: torch.Tensor, granularity: int) -> None:
    """Megatron-LM's virtual groups, in place: rows ``g*G .. g*G+G-1`` of the router ``weight`` (or
    bias) all become the fresh row ``g`` (the first ``E / G`` rows are kept, each repeated ``G`` times)."""
    if granularity == 1:
        return
    with torch.no_grad():
        weight.copy_(weight[: weight.shape[0] // granularity].repeat_interleave(granularity, dim=0))
