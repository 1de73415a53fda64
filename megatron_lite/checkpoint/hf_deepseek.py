"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``, ``model_type: deepseek_v3``) <-> megatron_lite's
single-process weights of a multi-latent-attention GPT (dense first layers, MoE after, multi-token prediction).

Names, per decoder layer ``model.layers.N.`` (ours ``decoder.layers.N.``); every tensor copies 1:1
except the SwiGLU pairs, which our fc1 holds stacked ``[gate; up]``:

=====================================  =========================================================
Hugging Face                           megatron_lite
=====================================  =========================================================
``input_layernorm``                    ``input_norm``
``self_attn.q_proj`` (no q_lora_rank)  ``self_attention.linear_q_proj``
``self_attn.q_a_proj`` / ``q_b_proj``  ``self_attention.linear_q_down_proj`` / ``linear_q_up_proj``
``self_attn.q_a_layernorm``            ``self_attention.q_layernorm``
``self_attn.kv_a_proj_with_mqa``       ``self_attention.linear_kv_down_proj`` (rows ``[latent | k_rope]``)
``self_attn.kv_a_layernorm``           ``self_attention.kv_layernorm``
``self_attn.kv_b_proj`` / ``o_proj``   ``self_attention.linear_kv_up_proj`` / ``linear_proj``
``post_attention_layernorm``           ``pre_mlp_norm``
``mlp.{gate,up,down}_proj`` (dense)    ``mlp.linear_fc1`` = [gate; up], ``mlp.linear_fc2``
``mlp.gate.weight``                    ``mlp.router.weight``
``mlp.gate.e_score_correction_bias``   ``mlp.router.expert_bias``
``mlp.experts.E.{gate,up,down}_proj``  expert E's fc1 = [gate; up] and fc2 (sequential or grouped GEMM)
``mlp.shared_experts.*``               ``mlp.shared_experts.linear_fc1`` = [gate; up], ``linear_fc2``
=====================================  =========================================================

Multi-token prediction depth k (``num_nextn_predict_layers``) is stored as the decoder layer
``model.layers.{L + k - 1}`` (L = ``num_hidden_layers``) with DeepSeek's extra tensors ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` (our ``mtp.layers.{k-1}.final_layernorm``) and copies of
the word embedding (``embed_tokens``) and output layer (``shared_head.head``), which our MTP shares:
on import they must equal the model's own. transformers keeps these weights but does not run them
in its forward pass. A folder whose config counts MTP layers but holds none of their weights (what
transformers saves for a model built without them) imports without MTP.

Rotary layout: with ``rope_interleave`` (DeepSeek's and the default) the rotary channels of
``q_b_proj`` and ``kv_a_proj_with_mqa`` are interleaved pairs, which MLA de-interleaves itself
(:func:`~megatron_lite.models.mla.apply_mla_rotary`): they copy 1:1. Without it they are in
rotate-half order and are interleaved on import. YaRN: ``rope_parameters`` (or the older
``rope_scaling``) ``factor`` / ``mscale`` / ``mscale_all_dim`` / ``original_max_position_embeddings`` /
``beta_fast`` / ``beta_slow`` are our ``--rotary-scaling-factor`` ... ``--beta-slow``. transformers
scales the rotary tables by ``attention_factor`` when given, else by our rule when both ``mscale`` and
``mscale_all_dim`` are set, else by ``get_mscale(factor)``: on import ``--mscale`` is the config's
when that gives the same scale and is solved for otherwise; on export an ``attention_factor`` is
written when transformers' rule would differ from ours. The softmax scale uses ``mscale_all_dim``
on both sides.

Routing (transformers' ``DeepseekV3TopkRouter``): sigmoid scores, selection on score + bias within
the ``topk_group`` best of ``n_group`` groups (a group scores its top 2), weights the selected
scores normalised (``norm_topk_prob``) times ``routed_scaling_factor``. Ours equals it with
``--moe-router-score-function sigmoid --moe-router-enable-expert-bias`` and, with groups,
``--moe-router-topk`` / ``--moe-router-group-topk`` = 2 (our group score sums the top topk/group_topk; a
group-topk equal to the group count keeps every group and is exported as ungrouped routing);
our sigmoid weights are normalised exactly when top-k > 1. A field config.json leaves out is read
as transformers reads it, with DeepseekV3Config's default (:data:`HF_DEFAULTS`), except the sizes the weights
give (:data:`SIZES`, :data:`MOE_SIZES`), refused naming the field as in every HF import. The router runs in fp32 (``--moe-router-dtype
fp32`` on import). What either side cannot express is refused with one line naming the option.
``--hidden-dropout``, ``--moe-input-jitter-eps`` and ``--moe-z-loss-coeff`` act in training only and have no
DeepSeek-V3 field: the export leaves them out with a warning (``--attention-dropout`` is ``attention_dropout``).
"""

from __future__ import annotations

import logging

import torch

from ..errors import ConfigError
from ..moe.layer_pattern import parse_moe_layer_freq
from .hf import _base_config, _require, pick_style, warn_unwritten
from .hf_deepseek_rope import rope_from_hf, rope_to_hf
from .hf_defaults import require_fields
from .hf_mixtral import SEQ, expert_matrices, stack_experts
from .hf_unused import strip_prefix

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm ignore rms_norm_eps
RENAMES = (  # (ours, Hugging Face) within one layer; the attention ones only when the tensor exists
    ("input_norm.weight", "input_layernorm.weight"), ("pre_mlp_norm.weight", "post_attention_layernorm.weight"),
    ("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight"),
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
)
MOE_RENAMES = (("mlp.router.weight", "mlp.gate.weight"), ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"))
SWIGLU = (("mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp."),
          ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts."))
MTP_RENAMES = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
               ("final_layernorm.weight", "shared_head.norm.weight"))
# What transformers' DeepseekV3Config reads for a field config.json leaves out (DeepSeek-V3's own values):
# the import reads the same (num_nextn_predict_layers aside: absent, no MTP is imported). The sizes the
# weights give (SIZES) are not filled, as in every HF import: a config.json without one is refused naming it.
HF_DEFAULTS = dict(
    routed_scaling_factor=2.5, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
    norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, initializer_range=0.02, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_interleave=True, attention_bias=False, attention_dropout=0.0,
)
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
         "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")  # the MoE ones: MOE_SIZES
MOE_SIZES = ("moe_intermediate_size", "n_routed_experts", "n_shared_experts")  # when a layer is MoE
log = logging.getLogger(__name__)


def _interleave_rope_rows(w: torch.Tensor, start: int, dr: int, period: int) -> torch.Tensor:
    """Rows ``[start, start + dr)`` of every ``period`` rows of ``w`` from rotate-half order
    (``[x0 .. x(d/2-1) | y0 ..]``) to interleaved pairs (``[x0, y0, x1, y1, ...]``)."""
    x = w.reshape(-1, period, *w.shape[1:]).clone()
    rope = x[:, start:start + dr]
    half = dr // 2
    x[:, start:start + dr] = torch.stack([rope[:, :half], rope[:, half:]], dim=2).reshape(rope.shape)
    return x.reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Export.


def _layer_pattern(cfg: dict) -> tuple[list[bool], int]:
    """(MoE or not per layer, first_k_dense_replace) of a pattern ``[dense] * k + [MoE] * (L - k)``."""
    layers = cfg["num_layers"]
    pattern = parse_moe_layer_freq(cfg.get("moe_layer_freq", 1), layers) if cfg.get("num_experts") else [False] * layers
    k = pattern.index(True) if any(pattern) else layers
    _require(all(pattern[k:]), f"--moe-layer-freq {cfg.get('moe_layer_freq')!r} cannot be expressed in the "
             "deepseek_v3 format (dense layers first, then every layer MoE: first_k_dense_replace)")
    return pattern, k


def grouped_routing(cfg: dict) -> bool:
    """Whether the router limits each token to some of its expert groups: ``--moe-router-num-groups``
    with a ``--moe-router-group-topk`` below it (keeping every group limits nothing, and is exported
    as ungrouped routing)."""
    groups = cfg.get("moe_router_num_groups")
    return bool(groups) and (cfg.get("moe_router_group_topk") or groups) < groups


def check_deepseek(cfg: dict) -> None:
    """Raise one ConfigError naming the first option the deepseek_v3 format cannot express."""
    _require(cfg.get("multi_latent_attention"), "a model without --multi-latent-attention cannot be expressed in the "
             "deepseek_v3 format; " + ("no format holds its --mtp-num-layers" if cfg.get("mtp_num_layers") else
                                       f"use --hf-style {pick_style(cfg)}"))
    for ok, words, why in (
            (cfg.get("qk_layernorm"), "no --qk-layernorm", "DeepSeek-V3 norms its latents"),
            (cfg.get("normalization") == "RMSNorm", "--normalization LayerNorm", "RMSNorm only"),
            (cfg.get("swiglu"), "a GeLU MLP (no --swiglu)", "SwiGLU only"),
            (cfg.get("disable_bias_linear"), "biases (no --disable-bias-linear)", "no biases"),
            (cfg.get("norm_epsilon") == LATENT_NORM_EPS, f"--norm-epsilon {cfg.get('norm_epsilon')}",
             "transformers' latent norms always use 1e-6: train with --norm-epsilon 1e-6")):
        _require(ok, f"{words} cannot be expressed in the deepseek_v3 format ({why})")
    _layer_pattern(cfg)
    rope_to_hf(cfg)
    if not cfg.get("num_experts"):
        return
    for name, ok, words in (("moe_router_score_function", "sigmoid", "--moe-router-score-function softmax"),
                            ("moe_shared_expert_gate", False, "--moe-shared-expert-gate"),
                            ("moe_expert_capacity_factor", None, "--moe-expert-capacity-factor (capacity dropping)")):
        value = cfg.get(name, ok)
        _require(value == ok or (ok is None and (value is None or value < 0)), f"{words} cannot be expressed in the "
                 "deepseek_v3 format")
    _require("sinkhorn" not in (cfg.get("moe_router_load_balancing_type") or []),
             "--moe-router-load-balancing-type sinkhorn cannot be expressed in the deepseek_v3 format")
    topk = cfg["moe_router_topk"]
    _require(not grouped_routing(cfg) or topk // cfg["moe_router_group_topk"] == 2, f"--moe-router-topk {topk} / "
             f"--moe-router-group-topk {cfg.get('moe_router_group_topk')} != 2 cannot be expressed in the deepseek_v3 "
             "format (a group scores the sum of its top 2 experts there)")
    shared, ffn = cfg.get("moe_shared_expert_intermediate_size"), cfg.get("moe_ffn_hidden_size") or cfg["ffn_hidden_size"]
    _require(not shared or shared % ffn == 0, f"--moe-shared-expert-intermediate-size {shared} cannot be expressed in "
             f"the deepseek_v3 format (n_shared_experts x moe_intermediate_size, {ffn})")


def _swiglu_out(out: dict, sd: dict, fc1: str, fc2: str, dst: str) -> None:
    gate, up = sd[fc1].chunk(2, dim=0)
    out.update({dst + "gate_proj.weight": gate.contiguous(), dst + "up_proj.weight": up.contiguous(),
                dst + "down_proj.weight": sd[fc2]})


def _layer_to_hf(out: dict, sd: dict, src: str, dst: str, moe: bool, experts: int) -> None:
    for ours, theirs in RENAMES + (MOE_RENAMES if moe else ()):
        if src + ours in sd:
            out[dst + theirs] = sd[src + ours]
    if moe and dst + "mlp.gate.e_score_correction_bias" not in out:  # no --moe-router-enable-expert-bias
        out[dst + "mlp.gate.e_score_correction_bias"] = torch.zeros(experts, dtype=torch.float32)
    for fc1, fc2, prefix in SWIGLU[1 if moe else 0:]:
        if src + fc1 in sd:
            _swiglu_out(out, sd, src + fc1, src + fc2, dst + prefix)
    if moe:
        for j, (fc1, fc2) in enumerate(expert_matrices(sd, src, experts)):
            gate, up = fc1.chunk(2, dim=0)
            e = dst + f"mlp.experts.{j}."
            out.update({e + "gate_proj.weight": gate.contiguous(), e + "up_proj.weight": up.contiguous(),
                        e + "down_proj.weight": fc2.contiguous()})


def _hf_config(cfg: dict, first_dense: int, embedding: torch.Tensor) -> dict:
    layers, heads, experts = cfg["num_layers"], cfg["num_attention_heads"], int(cfg.get("num_experts") or 0)
    ffn = cfg.get("ffn_hidden_size") or 4 * cfg["hidden_size"]
    moe_ffn = cfg.get("moe_ffn_hidden_size") or ffn
    topk, groups = int(cfg.get("moe_router_topk", 2)), cfg.get("moe_router_num_groups") if grouped_routing(cfg) else None
    rope_parameters, rope_scaling = rope_to_hf(cfg)
    dtype = str(embedding.dtype).replace("torch.", "")
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": cfg["hidden_size"], "intermediate_size": ffn, "moe_intermediate_size": moe_ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "n_shared_experts": (cfg.get("moe_shared_expert_intermediate_size") or 0) // moe_ffn,
        "n_routed_experts": max(experts, 1), "num_experts_per_tok": topk if experts else 1,
        "routed_scaling_factor": float(cfg.get("moe_router_topk_scaling_factor") or 1.0),
        "n_group": int(groups or 1), "topk_group": int(cfg.get("moe_router_group_topk") or 1) if groups else 1,
        "norm_topk_prob": topk > 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
        "first_k_dense_replace": first_dense, "kv_lora_rank": cfg["kv_lora_rank"], "q_lora_rank": cfg.get("q_lora_rank"),
        "qk_nope_head_dim": cfg["qk_head_dim"], "qk_rope_head_dim": cfg["qk_pos_emb_head_dim"],
        "v_head_dim": cfg["v_head_dim"], "num_nextn_predict_layers": int(cfg.get("mtp_num_layers") or 0),
        "hidden_act": "silu", "max_position_embeddings": cfg.get("max_position_embeddings") or cfg.get("seq_length"),
        "rms_norm_eps": LATENT_NORM_EPS, "rope_theta": rope_parameters["rope_theta"],
        "rope_parameters": rope_parameters, "rope_scaling": rope_scaling, "rope_interleave": True,
        "attention_bias": False, "attention_dropout": cfg.get("attention_dropout", 0.0),
        "tie_word_embeddings": not cfg.get("untie_embeddings_and_output_weights", False),
        "initializer_range": cfg.get("init_method_std", 0.02), "dtype": dtype, "torch_dtype": dtype, "use_cache": True,
    }


def to_deepseek(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a single-process, unpadded MLA state dict ``sd``."""
    check_deepseek(cfg)
    pattern, first_dense = _layer_pattern(cfg)
    layers, mtp = cfg["num_layers"], int(cfg.get("mtp_num_layers") or 0)
    experts = int(cfg.get("num_experts") or 0)
    if not any(pattern):
        first_dense = layers + mtp  # the MTP layers are dense like the last layer
    embedding = sd["embedding.word_embeddings.weight"]
    head = sd.get("output_layer.weight", embedding)
    out = {"model.embed_tokens.weight": embedding}
    for i in range(layers + mtp):
        src = f"decoder.layers.{i}." if i < layers else f"mtp.layers.{i - layers}.transformer_layer."
        _layer_to_hf(out, sd, src, f"model.layers.{i}.", i >= first_dense, experts)
    for k in range(mtp):
        src, dst = f"mtp.layers.{k}.", f"model.layers.{layers + k}."
        out.update({dst + theirs: sd[src + ours] for ours, theirs in MTP_RENAMES})
        out[dst + "embed_tokens.weight"], out[dst + "shared_head.head.weight"] = embedding, head
    out["model.norm.weight"] = sd["decoder.final_norm.weight"]
    if cfg.get("untie_embeddings_and_output_weights", False):
        out["lm_head.weight"] = head
    hf = _hf_config(cfg, first_dense, embedding)
    warn_unwritten(cfg, "deepseek_v3")
    return hf, out


# ---------------------------------------------------------------------------------------------
# Import.


def _routing_from_hf(hf: dict) -> dict:
    """Our router fields for the MoE layers of ``hf`` (the checks of the module docstring)."""
    for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        _require(hf.get(key, ok) == ok, f"{key} {hf.get(key)!r} cannot be expressed (transformers' DeepSeek-V3 "
                 f"router is {ok})")
    topk, groups, kept = hf.get("num_experts_per_tok") or 8, hf.get("n_group") or 1, hf.get("topk_group") or 1
    norm = hf.get("norm_topk_prob", True)
    _require(bool(norm) == (topk > 1), f"norm_topk_prob {norm} with num_experts_per_tok {topk} cannot be expressed "
             "(our sigmoid router normalises the weights exactly when top-k > 1)")
    grouped = groups > 1 and kept < groups
    _require(not grouped or topk // kept == 2, f"num_experts_per_tok {topk} / topk_group {kept} != 2 cannot be "
             "expressed (a group scores the sum of its top 2 there, of its top topk / group-topk here)")
    scale = float(hf.get("routed_scaling_factor", 1.0))
    require_fields(hf, MOE_SIZES)
    return dict(num_experts=hf["n_routed_experts"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_router_topk=topk, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=groups if grouped else None, moe_router_group_topk=kept if grouped else None,
                moe_router_topk_scaling_factor=None if scale == 1.0 else scale, moe_router_dtype="fp32",
                moe_shared_expert_intermediate_size=(hf["n_shared_experts"] or 0) * hf["moe_intermediate_size"] or None)


def _deepseek_config(hf: dict, mtp: int) -> tuple[dict, int]:
    """(flat config, first_k_dense_replace) of a DeepSeek-V3 config with ``mtp`` MTP layers present."""
    _require(not hf.get("quantization_config"), "quantization_config (FP8 block-quantised weights) cannot be "
             "imported; dequantise the weights to bf16 first (DeepSeek-V3's inference/fp8_cast_bf16.py)")
    _require(hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r} cannot be expressed "
             "(SwiGLU uses silu)")
    _require(not hf.get("attention_bias"), "attention_bias true cannot be expressed (MLA's projections have no bias)")
    _require(hf.get("rms_norm_eps", 1e-6) == LATENT_NORM_EPS, f"rms_norm_eps {hf.get('rms_norm_eps')} cannot be "
             "expressed (transformers' latent norms use 1e-6 whatever it says; ours use --norm-epsilon for every norm)")
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    _require(hf.get("num_key_value_heads") in (None, heads), "num_key_value_heads != num_attention_heads cannot be "
             "expressed (MLA expands keys and values for every head)")
    _require(hf.get("moe_layer_freq", 1) == 1, f"moe_layer_freq {hf.get('moe_layer_freq')} cannot be expressed "
             "(transformers makes every layer after first_k_dense_replace MoE)")
    k = min(hf.get("first_k_dense_replace") or 0, layers + mtp)
    _require(not layers <= k < layers + mtp, f"first_k_dense_replace {k} makes the multi-token prediction layers "
             "differ from the last decoder layer, which cannot be expressed (ours are built like it)")
    moe = _routing_from_hf(hf) if k < layers else {}
    if moe:
        moe["moe_layer_freq"] = f"([0]*{k}+[1]*{layers - k})" if k else "1"
    cfg = _base_config(
        num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=heads, num_query_groups=heads,
        kv_channels=hf["hidden_size"] // heads,  # what a run derives (MLA's head sizes are its own)
        ffn_hidden_size=hf["intermediate_size"], max_position_embeddings=hf["max_position_embeddings"],
        position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=LATENT_NORM_EPS, swiglu=True,
        disable_bias_linear=True, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0,
        init_method_std=hf.get("initializer_range", 0.02), vocab_size=hf["vocab_size"],
        multi_latent_attention=True, q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        qk_layernorm=True, mtp_num_layers=mtp or None, **rope_from_hf(hf), **moe,
    )
    return cfg, k


def _mtp_present(hf: dict, t: dict) -> int:
    """How many MTP layers the weights hold: ``num_nextn_predict_layers``, or 0 when none of them is there."""
    declared, layers = int(hf.get("num_nextn_predict_layers") or 0), hf["num_hidden_layers"]
    present = [any(k.startswith(f"layers.{layers + j}.") for k in t) for j in range(declared)]
    if declared and not any(present):
        log.warning("num_nextn_predict_layers is %d but the weights hold no multi-token prediction layer: "
                    "importing the model without MTP", declared)
        return 0
    return declared


def _same_copy(t: dict, name: str, want: torch.Tensor, what: str) -> None:
    if name in t:
        _require(torch.equal(t[name], want), f"model.{name} differs from {what}; cannot be expressed (our multi-token "
                 "prediction shares the word embedding and the output layer)")


def _layer_from_hf(sd: dict, t: dict, src: str, dst: str, moe: bool, cfg: dict) -> None:
    for ours, theirs in RENAMES + (MOE_RENAMES if moe else ()):
        if src + theirs in t:
            sd[dst + ours] = t[src + theirs]
    pairs = (SWIGLU[1:] if cfg["moe_shared_expert_intermediate_size"] else ()) if moe else SWIGLU[:1]
    for fc1, fc2, prefix in pairs:
        p = src + prefix
        sd[dst + fc1] = torch.cat([t[p + "gate_proj.weight"], t[p + "up_proj.weight"]])
        sd[dst + fc2] = t[p + "down_proj.weight"]
    if moe:
        fused = t.get(src + "mlp.experts.gate_up_proj")  # transformers' in-memory layout [E, 2 ffn, h]
        for j in range(cfg["num_experts"]):
            e, ours = src + f"mlp.experts.{j}.", dst + SEQ.format(j=j)
            sd[ours + "linear_fc1.weight"] = fused[j] if fused is not None else torch.cat(
                [t[e + "gate_proj.weight"], t[e + "up_proj.weight"]])
            sd[ours + "linear_fc2.weight"] = (t[src + "mlp.experts.down_proj"][j] if fused is not None
                                              else t[e + "down_proj.weight"])
    if not cfg.get("_rope_interleave", True):
        dn, dr = cfg["qk_head_dim"], cfg["qk_pos_emb_head_dim"]
        for name in ("self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight"):
            if dst + name in sd:
                sd[dst + name] = _interleave_rope_rows(sd[dst + name], dn, dr, dn + dr)
        kv = dst + "self_attention.linear_kv_down_proj.weight"
        sd[kv] = _interleave_rope_rows(sd[kv], cfg["kv_lora_rank"], dr, cfg["kv_lora_rank"] + dr)


def from_deepseek(hf: dict, hf_sd: dict, grouped: bool = False) -> tuple[dict, dict]:
    """(flat config, single-process unpadded state dict) of a DeepSeek-V3 config and tensors; the
    experts in the sequential layout, or stacked for ``--moe-grouped-gemm`` when ``grouped``."""
    hf = {**HF_DEFAULTS, **hf}
    require_fields(hf, SIZES)
    t = strip_prefix(hf_sd, "model.")
    mtp = _mtp_present(hf, t)
    cfg, first_dense = _deepseek_config(hf, mtp)
    layers = cfg["num_layers"]
    cfg["moe_grouped_gemm"] = grouped and bool(cfg["num_experts"])
    interleave = {"_rope_interleave": hf.get("rope_interleave", True)}
    try:
        embedding = t["embed_tokens.weight"]
        head = t["lm_head.weight"] if cfg["untie_embeddings_and_output_weights"] else embedding
        sd = {"embedding.word_embeddings.weight": embedding, "decoder.final_norm.weight": t["norm.weight"]}
        for i in range(layers + mtp):
            dst = f"decoder.layers.{i}." if i < layers else f"mtp.layers.{i - layers}.transformer_layer."
            _layer_from_hf(sd, t, f"layers.{i}.", dst, i >= first_dense, {**cfg, **interleave})
        for k in range(mtp):
            src, dst = f"layers.{layers + k}.", f"mtp.layers.{k}."
            sd.update({dst + ours: t[src + theirs] for ours, theirs in MTP_RENAMES})
            _same_copy(t, src + "embed_tokens.weight", embedding, "model.embed_tokens.weight")
            _same_copy(t, src + "shared_head.head.weight", head, "the output layer")
    except KeyError as err:
        raise ConfigError(f"the deepseek_v3 weights have no tensor {err.args[0]}; the folder does not match its "
                          "config.json") from None
    if cfg["untie_embeddings_and_output_weights"]:
        sd["output_layer.weight"] = head
    if cfg["moe_grouped_gemm"]:
        for prefix in [f"decoder.layers.{i}." for i in range(first_dense, layers)] + [
                f"mtp.layers.{k}.transformer_layer." for k in range(mtp) if layers + k >= first_dense]:
            stack_experts(sd, prefix, cfg["num_experts"])
    return cfg, {k: v.contiguous() for k, v in sd.items()}
