"""Hugging Face ``MixtralForCausalLM`` <-> megatron_lite's single-process mixture-of-experts GPT weights.

Mixtral is the llama layout (rotary ``rope_theta``, RMSNorm, grouped-query attention, no biases,
tied or untied) with every MLP replaced by a sparse MoE block: a router ``block_sparse_moe.gate``
``[E, h]`` (our ``mlp.router.weight``) and ``num_local_experts`` SwiGLU experts ``w1`` (gate),
``w3`` (up) and ``w2`` (down). Our expert fc1 is ``[gate; up]`` (``[2 * ffn, h]``) and fc2 is
``w2``; grouped-GEMM weights (``weight1 [E, h, 2 * ffn]``, ``weight2 [E, ffn, h]``) are the same
matrices transposed and stacked. Mixtral's routing is a softmax over all experts, the top
``num_experts_per_tok``, renormalised to sum to one: exactly our default post-top-k softmax.

What the format cannot express is refused with one line naming our option: shared experts, a
sigmoid router, expert bias, capacity dropping, group-limited routing, a pre-top-k softmax, a
top-k scaling factor, sinkhorn balancing, dense layers between MoE layers, biases. RoPE scaling is
the llama formats' (:mod:`.hf_rope`: ``llama3`` and ``linear``), both ways. Training-only
options carried over: ``--moe-input-jitter-eps`` <-> ``router_jitter_noise`` (Mixtral also scales
the experts' input by that noise in training, ours only the router's) and the aux-loss coefficient
<-> ``router_aux_loss_coef``; the z-loss and ``--hidden-dropout`` have no Mixtral field and are not written (a
warning says so); ``--attention-dropout`` is ``attention_dropout``. Mixtral's
``sliding_window`` (every layer) is ``--window-size`` as for Mistral (:mod:`.hf_mistral`).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..moe.layer_pattern import parse_moe_layer_freq
from .hf import (
    _base_config,
    _dims,
    _require,
    _silu_rope_theta,
    pick_style,
    qkv_to_separate,
    separate_to_qkv,
    warn_unwritten,
)
from .hf_defaults import with_hf_defaults
from .hf_mistral import hf_window, window_from_hf
from .hf_rope import rope_scaling_from_hf, rope_scaling_to_hf
from .hf_unused import strip_prefix

QKV, PROJ, ROUTER = "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.router.weight"
SEQ = "mlp.experts.local_experts.{j}."
# (our option, its value when Mixtral can express it, the refusal's words)
_UNEXPRESSIBLE = (  # --qk-layernorm first: its refusal names the way out (qwen3_moe)
    ("qk_layernorm", False, "--qk-layernorm (per-head query/key norms; use --hf-style qwen3_moe)"),
    ("moe_shared_expert_intermediate_size", None, "--moe-shared-expert-intermediate-size (shared experts)"),
    ("moe_router_score_function", "softmax", "--moe-router-score-function sigmoid"),
    ("moe_router_enable_expert_bias", False, "--moe-router-enable-expert-bias"),
    ("moe_expert_capacity_factor", None, "--moe-expert-capacity-factor (capacity dropping)"),
    ("moe_router_num_groups", None, "--moe-router-num-groups (group-limited routing)"),
    ("moe_router_pre_softmax", False, "--moe-router-pre-softmax (Mixtral renormalises the top-k)"),
    ("moe_router_topk_scaling_factor", None, "--moe-router-topk-scaling-factor"),
    ("add_qkv_bias", False, "--add-qkv-bias (the attention has no biases)"),
    ("rotary_percent", 1.0, "--rotary-percent below 1 (every channel of a head rotates)"),
)


def check_mixtral(cfg: dict, style: str = "mixtral", allowed: tuple = ()) -> None:
    """Raise one ConfigError naming the first option the mixtral format (or ``style``, a format with
    the same MoE layers that also expresses the options named in ``allowed``) cannot express."""
    _require(cfg.get("num_experts"), f"a dense model (no --num-experts) cannot be expressed in the {style} format; "
             f"use --hf-style {pick_style(cfg)}")
    for name, ok, words in _UNEXPRESSIBLE:
        if name in allowed:
            continue
        value = cfg.get(name, ok)
        if name == "moe_expert_capacity_factor" and value is not None and value < 0:
            value = None  # a negative factor means no capacity limit
        _require(value == ok or (ok is None and not value), f"{words} cannot be expressed in the {style} format")
    _require("sinkhorn" not in (cfg.get("moe_router_load_balancing_type") or []),
             f"--moe-router-load-balancing-type sinkhorn cannot be expressed in the {style} format")
    _require("moe_layer_freq" in allowed or all(parse_moe_layer_freq(cfg.get("moe_layer_freq", 1), cfg["num_layers"])),
             f"--moe-layer-freq {cfg.get('moe_layer_freq')!r} (dense layers) cannot be expressed in the {style} "
             "format (every layer is MoE)")
    _require(cfg.get("position_embedding_type") == "rope", "--position-embedding-type learned_absolute cannot be "
             f"expressed in the {style} format (rotary only)")
    _require(cfg.get("normalization") == "RMSNorm", "--normalization LayerNorm cannot be expressed in the "
             f"{style} format (RMSNorm only)")
    _require("swiglu" in allowed or cfg.get("swiglu"), f"a GeLU MLP (no --swiglu) cannot be expressed in the {style} "
             "format (SwiGLU experts)")
    _require("disable_bias_linear" in allowed or cfg.get("disable_bias_linear"), f"biases (no --disable-bias-linear) "
             f"cannot be expressed in the {style} format" + ("; use --hf-style gpt_oss" if cfg.get("quick_geglu") else ""))


def _aux_coeff(cfg: dict) -> float:
    types, coeffs = cfg.get("moe_router_load_balancing_type") or [], cfg.get("moe_aux_loss_coeff") or []
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs]
    return float(next((c for t, c in zip(types, coeffs * len(types)) if t == "aux_loss"), 0.0))


def expert_matrices(sd: dict, prefix: str, experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fc1 ``[2 * ffn, h]``, fc2 ``[h, ffn]``) of each expert of layer ``prefix``, either weight layout."""
    if prefix + "mlp.experts.weight1" in sd:
        w1, w2 = sd[prefix + "mlp.experts.weight1"], sd[prefix + "mlp.experts.weight2"]
        return [(w1[j].t(), w2[j].t()) for j in range(experts)]
    return [(sd[prefix + SEQ.format(j=j) + "linear_fc1.weight"], sd[prefix + SEQ.format(j=j) + "linear_fc2.weight"])
            for j in range(experts)]


def stack_experts(sd: dict, prefix: str, experts: int) -> None:
    """Replace the sequential experts of layer ``prefix`` in ``sd`` by the grouped-GEMM stacks
    (``mlp.experts.weight1 [E, h, 2 * ffn]``, ``weight2 [E, ffn, h]``), in place."""
    pairs = expert_matrices(sd, prefix, experts)
    for j in range(experts):
        del sd[prefix + SEQ.format(j=j) + "linear_fc1.weight"], sd[prefix + SEQ.format(j=j) + "linear_fc2.weight"]
    sd[prefix + "mlp.experts.weight1"] = torch.stack([fc1.t() for fc1, _ in pairs])
    sd[prefix + "mlp.experts.weight2"] = torch.stack([fc2.t() for _, fc2 in pairs])


def to_mixtral(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a single-process, unpadded MoE state dict ``sd``."""
    check_mixtral(cfg)
    layers, hidden, heads, groups, d = _dims(cfg)
    experts, tied = int(cfg["num_experts"]), not cfg.get("untie_embeddings_and_output_weights", False)
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"]}
    for i in range(layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = qkv_to_separate(sd[src + QKV], heads, groups, d)
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v, dst + "self_attn.o_proj.weight": sd[src + PROJ],
                    dst + "input_layernorm.weight": sd[src + "input_norm.weight"],
                    dst + "post_attention_layernorm.weight": sd[src + "pre_mlp_norm.weight"],
                    dst + "block_sparse_moe.gate.weight": sd[src + ROUTER]})
        for j, (fc1, fc2) in enumerate(expert_matrices(sd, src, experts)):
            gate, up = fc1.chunk(2, dim=0)
            e = dst + f"block_sparse_moe.experts.{j}."
            out.update({e + "w1.weight": gate.contiguous(), e + "w3.weight": up.contiguous(), e + "w2.weight": fc2.contiguous()})
    out["model.norm.weight"] = sd["decoder.final_norm.weight"]
    if not tied:
        out["lm_head.weight"] = sd["output_layer.weight"]
    dtype = str(sd["embedding.word_embeddings.weight"].dtype).replace("torch.", "")
    theta = float(cfg.get("rotary_base", 10000))
    rope_parameters, rope_scaling = rope_scaling_to_hf(cfg, theta)
    hf = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": int(cfg["vocab_size"]),
          "tie_word_embeddings": tied, "dtype": dtype, "torch_dtype": dtype, "use_cache": True,
          "initializer_range": cfg.get("init_method_std", 0.02), "num_hidden_layers": layers, "hidden_size": hidden,
          "intermediate_size": cfg.get("moe_ffn_hidden_size") or cfg.get("ffn_hidden_size") or 4 * hidden,
          "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": d,
          "max_position_embeddings": cfg.get("max_position_embeddings") or cfg.get("seq_length"),
          "rms_norm_eps": cfg.get("norm_epsilon", 1e-5), "rope_theta": theta,
          "rope_parameters": rope_parameters, "hidden_act": "silu",
          "attention_dropout": cfg.get("attention_dropout", 0.0), "sliding_window": _sliding_window(cfg),
          "num_local_experts": experts, "num_experts_per_tok": int(cfg.get("moe_router_topk", 2)),
          "router_jitter_noise": float(cfg.get("moe_input_jitter_eps") or 0.0), "router_aux_loss_coef": _aux_coeff(cfg),
          "output_router_logits": False}
    if rope_scaling:
        hf["rope_scaling"] = rope_scaling
    warn_unwritten(cfg, "mixtral", written=("moe_input_jitter_eps",))  # router_jitter_noise
    return hf, out


def _sliding_window(cfg: dict) -> int | None:
    """Mixtral's ``sliding_window`` (every layer) of our --window-size (hf_mistral.py)."""
    window, windowed = hf_window(cfg, "mixtral")
    _require(all(windowed) or not any(windowed), f"--window-attn-skip-freq {cfg.get('window_attn_skip_freq')} "
             "cannot be expressed in the mixtral format (its window is in every layer)")
    return window


def _mixtral_config(hf: dict) -> dict:
    theta = _silu_rope_theta(hf, 1e6, scaling=True)
    scaling = rope_scaling_from_hf(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    hidden, heads, ffn = hf["hidden_size"], hf["num_attention_heads"], hf["intermediate_size"]
    groups = hf.get("num_key_value_heads") or heads
    jitter = hf.get("router_jitter_noise") or None
    return _base_config(
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups, kv_channels=hf.get("head_dim") or hidden // heads,
        ffn_hidden_size=ffn, max_position_embeddings=hf["max_position_embeddings"], position_embedding_type="rope",
        rotary_base=int(theta), normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-5), swiglu=True,
        disable_bias_linear=True, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0,
        init_method_std=hf.get("initializer_range", 0.02), vocab_size=hf["vocab_size"],
        num_experts=hf["num_local_experts"], moe_ffn_hidden_size=ffn, moe_router_topk=hf.get("num_experts_per_tok", 2),
        moe_layer_freq="1", moe_input_jitter_eps=jitter, moe_router_load_balancing_type=["aux_loss"],
        moe_aux_loss_coeff=[float(hf.get("router_aux_loss_coef", 0.0))],
        **window_from_hf(hf.get("sliding_window"), [True] * hf["num_hidden_layers"]), **scaling,
    )


def from_mixtral(hf: dict, hf_sd: dict, grouped: bool = False) -> tuple[dict, dict]:
    """(flat config, single-process unpadded state dict) of a Mixtral config and tensors; the experts
    in the sequential layout, or stacked for ``--moe-grouped-gemm`` when ``grouped``."""
    hf = with_hf_defaults(hf, "mixtral")
    cfg = _mixtral_config(hf)
    cfg["moe_grouped_gemm"] = grouped
    layers, _, heads, groups, d = _dims(cfg)
    t = strip_prefix(hf_sd, "model.")
    try:
        sd = {"embedding.word_embeddings.weight": t["embed_tokens.weight"], "decoder.final_norm.weight": t["norm.weight"]}
        for i in range(layers):
            src, dst, a = f"layers.{i}.", f"decoder.layers.{i}.", f"layers.{i}.self_attn."
            sd[dst + QKV] = separate_to_qkv(t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"],
                                            heads, groups, d)
            sd[dst + PROJ] = t[a + "o_proj.weight"]
            sd[dst + "input_norm.weight"] = t[src + "input_layernorm.weight"]
            sd[dst + "pre_mlp_norm.weight"] = t[src + "post_attention_layernorm.weight"]
            sd[dst + ROUTER] = t[src + "block_sparse_moe.gate.weight"]
            for j in range(cfg["num_experts"]):
                e, ours = src + f"block_sparse_moe.experts.{j}.", dst + SEQ.format(j=j)
                sd[ours + "linear_fc1.weight"] = torch.cat([t[e + "w1.weight"], t[e + "w3.weight"]])
                sd[ours + "linear_fc2.weight"] = t[e + "w2.weight"]
    except KeyError as err:
        raise ConfigError(f"the mixtral weights have no tensor {err.args[0]}; the folder does not match its "
                          "config.json (only the per-expert w1/w2/w3 layout is read)") from None
    if cfg["untie_embeddings_and_output_weights"]:
        _require("lm_head.weight" in hf_sd, "tie_word_embeddings is false but the weights have no lm_head.weight")
        sd["output_layer.weight"] = hf_sd["lm_head.weight"]
    if grouped:
        for i in range(layers):
            stack_experts(sd, f"decoder.layers.{i}.", cfg["num_experts"])
    return cfg, {k: v.contiguous() for k, v in sd.items()}
