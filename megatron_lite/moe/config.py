"""The mixture-of-experts flags (Megatron-LM's names and defaults) and their validation.

:class:`MoEConfig` is one section of the run's Config, and TransformerConfig derives from it, so
every layer sees the same fields. :func:`check_moe_fields` (called by TransformerConfig) fills the
defaults and raises ConfigError with one line naming the flag and the fix;
:func:`moe_config_problem` returns that line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from .layer_pattern import parse_moe_layer_freq

LOAD_BALANCING_TYPES = ["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
MOE_CHOICES = {
    "moe_router_load_balancing_type": LOAD_BALANCING_TYPES,
    "moe_router_score_function": ["softmax", "sigmoid"],
    "moe_router_dtype": ["fp32", "fp64"],
    "moe_token_dispatcher_type": ["allgather", "alltoall", "flex"],
    "moe_token_drop_policy": ["probs", "position"],
}
# Flags for GPU-only fused kernels or features not built here: refused rather than ignored.
REFUSED = {
    "moe_router_fusion": "fused router kernels need Transformer Engine on a GPU",
    "moe_permute_fusion": "fused permute kernels need Transformer Engine on a GPU",
    "moe_enable_deepep": "DeepEP (flex dispatcher) needs its GPU kernels",
    "moe_router_force_load_balancing": "benchmark-only random routing is not implemented",
    "moe_apply_probs_on_input": "weights are applied after the activation only",
    "moe_shared_expert_overlap": "overlapping shared experts with the dispatcher is not implemented",
    "overlap_moe_expert_parallel_comm": "batch-level all-to-all overlap is not implemented",
    "moe_extended_tp": "deprecated in Megatron-LM; use --expert-tensor-parallel-size",
}


@dataclass
class MoEConfig:
    num_experts: int | None = None
    """Number of experts per MoE layer (None or 0: a dense model)."""
    moe_ffn_hidden_size: int | None = None
    """FFN hidden size of each expert (default --ffn-hidden-size)."""
    moe_layer_freq: str = "1"
    """MoE layer pattern: N (every N-th layer from layer 0) or a list expression like "([0]+[1]*3)"."""
    moe_router_topk: int = 2
    """Number of experts each token is routed to."""
    moe_router_load_balancing_type: list[str] = field(default_factory=lambda: ["aux_loss"])
    """Load balancing: aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none (several allowed)."""
    moe_aux_loss_coeff: list[float] = field(default_factory=lambda: [0.0])
    """Load-balancing loss coefficient (one per --moe-router-load-balancing-type); 1e-2 is a good start."""
    moe_z_loss_coeff: float | None = None
    """Router z-loss coefficient (1e-3 is a good start)."""
    moe_input_jitter_eps: float | None = None
    """Multiply the router input by U(1-eps, 1+eps) noise in training."""
    moe_router_score_function: str = "softmax"
    """Router score function: softmax or sigmoid."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (default: softmax over the k selected)."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiply the selected routing weights by this factor."""
    moe_router_num_groups: int | None = None
    """Expert groups for group-limited routing."""
    moe_router_group_topk: int | None = None
    """Groups each token may route into (group-limited routing)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias on the selection, updated every step (sigmoid router)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step size of the expert-bias update."""
    moe_router_dtype: str | None = None
    """Router GEMM, weights and weighted sum in fp32 or fp64 (default: the model dtype)."""
    moe_router_fusion: bool = False
    """Fused router kernels (refused: GPU-only)."""
    moe_router_padding_for_fp8: bool = False
    """Pad every expert's token count on each rank to the FP8 GEMM alignment (16; 32 with --fp8-recipe mxfp8, 128 with blockwise) with zero-weight padding tokens that change no output or gradient (needs --fp8-format, --num-experts and --moe-token-dispatcher-type alltoall)."""
    moe_router_force_load_balancing: bool = False
    """Random router logits for benchmarking (refused)."""
    moe_token_dispatcher_type: str = "allgather"
    """Token dispatcher: allgather or alltoall (flex is refused)."""
    moe_enable_deepep: bool = False
    """DeepEP for the flex dispatcher (refused)."""
    moe_permute_fusion: bool = False
    """Fused permute/unpermute (refused: GPU-only)."""
    moe_expert_capacity_factor: float | None = None
    """Capacity per expert as a multiple of the even share (default: no dropping)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to exactly the capacity (needs --moe-expert-capacity-factor)."""
    moe_token_drop_policy: str = "probs"
    """Which tokens an expert over capacity drops: probs (lowest weights) or position (latest)."""
    moe_apply_probs_on_input: bool = False
    """Weight the expert input instead of its activation (refused)."""
    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM instead of a loop."""
    moe_use_legacy_grouped_gemm: bool = False
    """Same as --moe-grouped-gemm here."""
    moe_shared_expert_intermediate_size: int | None = None
    """FFN hidden size of the shared experts (all of them together)."""
    moe_shared_expert_overlap: bool = False
    """Overlap shared experts with the dispatcher (refused)."""
    moe_shared_expert_gate: bool = field(default=False, metadata={"cli": False})
    """Scale the shared experts' output per token by a learned sigmoid gate (set in code)."""
    moe_per_layer_logging: bool = False
    """Write the router losses of every MoE layer to TensorBoard (needs --moe-aux-loss-coeff or --moe-z-loss-coeff)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size of the experts (default --tensor-model-parallel-size; 1: whole experts). Another size, or an --expert-model-parallel-size that does not divide the data-parallel size, re-cuts each pipeline stage's ranks (TP x CP x DP) for the experts as ETP x EP x expert-DP (parallel folding; EP may span CP ranks). Needs --num-experts."""
    overlap_moe_expert_parallel_comm: bool = False
    """Overlap the expert-parallel all-to-all across micro-batches (refused)."""
    moe_layer_recompute: bool = False
    """Megatron-LM's deprecated spelling of --recompute-granularity selective --recompute-modules moe (moe is added to the modules, by default core_attn)."""
    moe_extended_tp: bool = False
    """Deprecated (refused)."""
    moe_use_upcycling: bool = False
    """Start the MoE model from the dense checkpoint at --load (one with experts is loaded as is): each MoE layer's experts are copies of its dense MLP, routers fresh, iteration 0, a fresh optimizer."""
    moe_upcycling_granularity: int = 1
    """Upcycling: cut each dense MLP into this many experts along its FFN dimension (--moe-ffn-hidden-size: the dense width / this; --num-experts and --moe-router-topk: multiples of it)."""


def normalize(moe: MoEConfig, ffn_hidden_size: int) -> None:
    """Megatron's normalisations: 0 experts is dense, a negative capacity factor means none, the
    expert FFN width defaults to the dense one, a coefficient list of one applies to every type."""
    if moe.num_experts == 0:
        moe.num_experts = None
    if moe.moe_expert_capacity_factor is not None and moe.moe_expert_capacity_factor < 0:
        moe.moe_expert_capacity_factor = None
    if moe.num_experts and moe.moe_ffn_hidden_size is None:
        moe.moe_ffn_hidden_size = ffn_hidden_size
    if isinstance(moe.moe_router_load_balancing_type, str):
        moe.moe_router_load_balancing_type = [moe.moe_router_load_balancing_type]
    if isinstance(moe.moe_aux_loss_coeff, (int, float)):
        moe.moe_aux_loss_coeff = [float(moe.moe_aux_loss_coeff)]
    if len(moe.moe_aux_loss_coeff) == 1:
        moe.moe_aux_loss_coeff = moe.moe_aux_loss_coeff * len(moe.moe_router_load_balancing_type)


def moe_config_problem(moe: MoEConfig, *, num_layers: int, tp: int, ep: int, sequence_parallel: bool,
                       fp16: bool = False, fp8: str | None = None) -> str | None:
    """The first bad MoE flag combination as one line naming the flag and the fix, or None.

    Call after :func:`normalize`. ``sequence_parallel`` is the value the user asked for; ``fp8`` the
    FP8 format (None: no FP8).
    """
    for name, why in REFUSED.items():
        if getattr(moe, name):
            return f"--{name.replace('_', '-')} is not supported: {why}; drop it"
    if moe.moe_router_padding_for_fp8 and (problem := _padding_problem(moe, fp8)):
        return problem
    if not moe.num_experts:
        if ep > 1:
            return "--expert-model-parallel-size > 1 needs mixture-of-experts layers; set --num-experts"
        return None
    return _routing_problem(moe) or _parallel_problem(moe, num_layers=num_layers, tp=tp, ep=ep,
                                                      sequence_parallel=sequence_parallel, fp16=fp16)


# flags with a refusal of their own for a dense model (or none to give: set in code)
_OWN_DENSE_RULE = {"num_experts", "moe_shared_expert_gate", "moe_router_padding_for_fp8", "expert_tensor_parallel_size"}


def unused_moe_flag(moe: MoEConfig) -> str | None:
    """A run's MoE flag given a value other than its default that the model would ignore, as one line
    naming it, else None: any of them without --num-experts, the bias update rate without the expert
    bias. Checked for a run's flags only, so a checkpoint whose config recorded such a value still loads."""
    if moe.num_experts:
        rate = moe.moe_router_bias_update_rate
        if not moe.moe_router_enable_expert_bias and rate != _default(MoEConfig, "moe_router_bias_update_rate"):
            return (f"--moe-router-bias-update-rate {rate} has no effect without --moe-router-enable-expert-bias; "
                    "add it (with --moe-router-score-function sigmoid) or drop the rate")
        return _coefficient_of_none(moe) or _nothing_to_log_per_layer(moe)
    for f in dataclasses.fields(MoEConfig):
        if f.name in _OWN_DENSE_RULE or f.name in REFUSED:
            continue
        value, default = getattr(moe, f.name), _default(MoEConfig, f.name)
        if isinstance(default, list) and not isinstance(value, list):
            value = [value]
        if value != default and str(value) != str(default):
            shown = " ".join(map(str, value)) if isinstance(value, list) else ("" if value is True else value)
            flag = f"--{f.name.replace('_', '-')}"
            return (f"{flag} {shown}".rstrip() + " has no effect without --num-experts (this model has no "
                    f"experts); add --num-experts or drop {flag}")
    return None


def _coefficient_of_none(moe: MoEConfig) -> str | None:
    """A non-zero --moe-aux-loss-coeff for --moe-router-load-balancing-type none (no loss to scale)."""
    types, coeffs = moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff
    types = [types] if isinstance(types, str) else list(types)
    coeffs = [coeffs] * len(types) if isinstance(coeffs, (int, float)) else list(coeffs)
    if len(coeffs) == 1:
        coeffs = coeffs * len(types)
    if any(t == "none" and c for t, c in zip(types, coeffs)):
        return (f"--moe-aux-loss-coeff {' '.join(map(str, coeffs))} has no effect with --moe-router-load-balancing-type "
                f"{' '.join(types)} (no load-balancing loss to scale); give the none type a coefficient of 0, "
                "or pick aux_loss, seq_aux_loss or global_aux_loss")
    return None


def _nothing_to_log_per_layer(moe: MoEConfig) -> str | None:
    """--moe-per-layer-logging writes each MoE layer's router losses; with every --moe-aux-loss-coeff 0
    (the default) and no --moe-z-loss-coeff there are none, and it wrote nothing."""
    coeffs = moe.moe_aux_loss_coeff
    coeffs = [coeffs] if isinstance(coeffs, (int, float)) else list(coeffs)
    if not moe.moe_per_layer_logging or moe.moe_z_loss_coeff or any(coeffs):
        return None
    return ("--moe-per-layer-logging writes each MoE layer's router losses and this run has none "
            "(--moe-aux-loss-coeff 0, no --moe-z-loss-coeff); give a coefficient or drop --moe-per-layer-logging")


def _default(cls, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _padding_problem(moe: MoEConfig, fp8: str | None) -> str | None:
    """Megatron-LM's rules for --moe-router-padding-for-fp8: FP8 experts fed by the all-to-all dispatcher."""
    flag = "--moe-router-padding-for-fp8"
    if not moe.num_experts:
        return f"{flag} pads the experts' token counts and needs --num-experts; drop it for a dense model"
    if fp8 is None:
        return f"{flag} needs FP8 (--fp8-format e4m3 or hybrid); add it or drop {flag}"
    if moe.moe_token_dispatcher_type != "alltoall":
        return (f"{flag} needs --moe-token-dispatcher-type alltoall (got {moe.moe_token_dispatcher_type}); "
                f"switch the dispatcher or drop {flag}")
    return None


def _routing_problem(moe: MoEConfig) -> str | None:
    e, k = moe.num_experts, moe.moe_router_topk
    types, coeffs = moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff
    if e < 1:
        return f"--num-experts {e} must be positive"
    if not 1 <= k <= e:
        return f"--moe-router-topk {k} must be between 1 and --num-experts {e}"
    if moe.moe_ffn_hidden_size is not None and moe.moe_ffn_hidden_size < 1:
        return f"--moe-ffn-hidden-size {moe.moe_ffn_hidden_size} must be positive (the width of each expert's MLP)"
    if moe.moe_expert_capacity_factor == 0:
        return ("--moe-expert-capacity-factor 0 gives every expert 0 slots (every token dropped); "
                "give a positive factor, or leave it unset for no dropping")
    if (problem := _sign_problem(moe)):
        return problem
    if len(coeffs) != len(types):
        return (f"--moe-aux-loss-coeff has {len(coeffs)} values for {len(types)} "
                "--moe-router-load-balancing-type values; give one each (or a single coefficient)")
    if "sinkhorn" in types and any(c for t, c in zip(types, coeffs) if t == "sinkhorn"):
        return "--moe-router-load-balancing-type sinkhorn needs --moe-aux-loss-coeff 0"
    if k == 1 and moe.moe_router_score_function == "softmax" and not moe.moe_router_pre_softmax \
            and "sinkhorn" not in types:
        return "--moe-router-topk 1 with a post-top-k softmax gives every weight 1; add --moe-router-pre-softmax"
    if moe.moe_router_pre_softmax and moe.moe_router_score_function != "softmax" and "sinkhorn" not in types:
        return (f"--moe-router-pre-softmax has no effect with --moe-router-score-function "
                f"{moe.moe_router_score_function} (it orders the softmax before the top-k); drop it")
    if moe.moe_expert_capacity_factor is not None and "sinkhorn" in types:
        return "--moe-expert-capacity-factor does not work with sinkhorn load balancing; drop one of them"
    if "sinkhorn" in types and (ignored := _ignored_by_sinkhorn(moe)):
        return (f"{ignored} has no effect with --moe-router-load-balancing-type sinkhorn (it routes by its own "
                "balanced scores, weights sigmoid for top-1 / softmax otherwise); drop one of them")
    if moe.moe_pad_expert_input_to_capacity and moe.moe_expert_capacity_factor is None:
        return "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"
    if moe.moe_token_drop_policy != "probs" and moe.moe_expert_capacity_factor is None:
        return (f"--moe-token-drop-policy {moe.moe_token_drop_policy} needs --moe-expert-capacity-factor "
                "(without a capacity no token is dropped)")
    groups, group_topk = moe.moe_router_num_groups, moe.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        return "group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk"
    if groups is not None:
        if groups < 1 or e % groups:
            return f"--num-experts {e} must be divisible by --moe-router-num-groups {groups}"
        if not 1 <= group_topk <= min(groups, k):
            return f"--moe-router-group-topk {group_topk} must be between 1 and min(--moe-router-num-groups, --moe-router-topk)"
        if k > group_topk * (e // groups):  # the kept groups must hold k experts (else k out of range)
            return (f"--moe-router-topk {k} is more than the {group_topk * (e // groups)} experts a token can reach in "
                    f"--moe-router-group-topk {group_topk} of the --moe-router-num-groups {groups} groups "
                    f"({e // groups} experts each); raise --moe-router-group-topk or lower --moe-router-num-groups")
    if moe.moe_router_enable_expert_bias and moe.moe_router_score_function != "sigmoid":
        return "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"
    if moe.moe_token_dispatcher_type == "flex":
        return "--moe-token-dispatcher-type flex needs DeepEP GPU kernels; use alltoall or allgather"
    return None


def _sign_problem(moe: MoEConfig) -> str | None:
    """Router numbers of the wrong sign: a scaling factor of 0 was ignored and a negative one flips
    every expert's output; negative loss coefficients or bias rate reward the imbalance they fight."""
    scale = moe.moe_router_topk_scaling_factor
    if scale is not None and scale <= 0:
        return f"--moe-router-topk-scaling-factor {scale} must be positive (leave it unset for 1)"
    for flag, value in (("--moe-aux-loss-coeff", min(moe.moe_aux_loss_coeff, default=0.0)),
                        ("--moe-z-loss-coeff", moe.moe_z_loss_coeff or 0.0),
                        ("--moe-router-bias-update-rate", moe.moe_router_bias_update_rate)):
        if value < 0:
            return f"{flag} {value} must not be negative (a negative value rewards what it should penalise)"
    eps = moe.moe_input_jitter_eps
    if eps is not None and not 0 <= eps < 1:  # the router's input is multiplied by uniform(1 - eps, 1 + eps)
        return f"--moe-input-jitter-eps {eps} must be in [0, 1) (at {eps} the noise can zero or flip the router's input)"
    return None


def _ignored_by_sinkhorn(moe: MoEConfig) -> str | None:
    """The first top-k routing flag sinkhorn routing would silently ignore, or None."""
    for flag, used in (("--moe-router-enable-expert-bias", moe.moe_router_enable_expert_bias),
                       ("--moe-router-num-groups", moe.moe_router_num_groups is not None),
                       ("--moe-router-score-function sigmoid", moe.moe_router_score_function != "softmax"),
                       ("--moe-router-pre-softmax", moe.moe_router_pre_softmax),
                       ("--moe-router-topk-scaling-factor", bool(moe.moe_router_topk_scaling_factor))):
        if used:
            return flag
    return None


def _parallel_problem(moe: MoEConfig, *, num_layers, tp, ep, sequence_parallel, fp16) -> str | None:
    e = moe.num_experts
    if e % ep:
        return f"--num-experts {e} must be divisible by --expert-model-parallel-size {ep}"
    if tp > 1 and not sequence_parallel:
        return "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel"
    etp = moe.expert_tensor_parallel_size
    if etp is not None and (not isinstance(etp, int) or etp < 1):
        return f"--expert-tensor-parallel-size {etp} must be a positive integer (default: --tensor-model-parallel-size)"
    if moe.moe_ffn_hidden_size % (etp or tp):
        flag = "--tensor-model-parallel-size" if etp is None else "--expert-tensor-parallel-size"
        return f"--moe-ffn-hidden-size {moe.moe_ffn_hidden_size} is not divisible by {flag} {etp or tp}"
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None and (shared < 1 or shared % tp):
        return f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by --tensor-model-parallel-size {tp}"
    if fp16 and ep > 1:
        return "--expert-model-parallel-size > 1 does not support --fp16; use --bf16"
    if fp16 and etp not in (None, 1, tp):
        return "--expert-tensor-parallel-size other than 1 or --tensor-model-parallel-size does not support --fp16; use --bf16"
    try:
        parse_moe_layer_freq(moe.moe_layer_freq, num_layers)
    except (ValueError, SyntaxError) as err:
        return str(err) if str(err).startswith("--moe") else f"--moe-layer-freq {moe.moe_layer_freq!r}: {err}"
    return None


def check_moe_fields(config) -> None:
    """Normalise and validate the MoE fields of a TransformerConfig (ConfigError with one line)."""
    normalize(config, config.ffn_hidden_size)
    problem = moe_config_problem(
        config, num_layers=config.num_layers, tp=config.tensor_model_parallel_size,
        ep=config.expert_model_parallel_size,
        sequence_parallel=config.sequence_parallel or config.moe_split_tokens_over_tp,
        fp16=config.params_dtype == torch.float16, fp8=config.fp8)
    if problem:
        raise ConfigError(problem)


def moe_fields(moe: MoEConfig) -> dict:
    """The MoEConfig section as keyword arguments of TransformerConfig (the legacy grouped-GEMM flag
    selects the same grouped experts)."""
    values = dataclasses.asdict(moe)
    values["moe_grouped_gemm"] = moe.moe_grouped_gemm or moe.moe_use_legacy_grouped_gemm
    return values


def moe_layer_pattern(config) -> list[bool]:
    """Per layer (0-based), whether it is an MoE layer (all False for a dense model)."""
    if not config.num_experts:
        return [False] * config.num_layers
    return parse_moe_layer_freq(config.moe_layer_freq, config.num_layers)


def expert_grid_tp(config) -> int | None:
    """--expert-tensor-parallel-size for the rank grid of a run's Config (None: dense model, or the TP size)."""
    return config.moe.expert_tensor_parallel_size if config.moe.num_experts else None


def saved_moe_fields(saved: dict, fp8: bool = False) -> dict:
    """The MoEConfig fields a checkpoint's flat config records, for a model built from it. Without FP8
    (inference, merging, conversion, LoRA export) ``--moe-router-padding-for-fp8`` is dropped: it only
    pads the FP8 GEMMs' token counts and changes no output, and it is refused without FP8."""
    fields = {f.name: saved[f.name] for f in dataclasses.fields(MoEConfig) if f.name in saved}
    if not fp8:
        fields["moe_router_padding_for_fp8"] = False
    return fields
