"""Hugging Face ``qwen3`` (``Qwen3ForCausalLM``) and ``qwen3_moe`` (``Qwen3MoeForCausalLM``) <-> megatron_lite's
single-process GPT weights.

Qwen3 is the llama layout (:mod:`~megatron_lite.checkpoint.hf`: RoPE, RMSNorm, SwiGLU, grouped-query
attention, no biases, tied or untied, ``head_dim`` possibly other than hidden / heads: our
``--kv-channels``) with per-head RMSNorms of the queries and keys before the rotation:
``self_attn.q_norm`` / ``k_norm`` ``[head_dim]`` are our ``self_attention.q_layernorm`` /
``k_layernorm`` (``--qk-layernorm``). ``attention_bias`` (biases on q/k/v *and* o_proj, none in the
MLP) and sliding-window attention are refused.

Qwen3-MoE adds Mixtral-like expert layers (:mod:`~megatron_lite.checkpoint.hf_mixtral`) under other
names: the router ``mlp.gate`` ``[E, h]`` and SwiGLU experts ``mlp.experts.{j}.gate_proj / up_proj /
down_proj`` (``moe_intermediate_size``: our ``--moe-ffn-hidden-size``). Its routing is a softmax over
every expert, then the top ``num_experts_per_tok``; ``norm_topk_prob`` true renormalises them to sum
to one, which is our default post-top-k softmax, false keeps them, which is
``--moe-router-pre-softmax``. The layers that are MoE (``decoder_sparse_step``, ``mlp_only_layers``)
become a ``--moe-layer-freq`` list; the dense ones are SwiGLU MLPs of ``intermediate_size``
(``--ffn-hidden-size``). RoPE scaling is the llama formats' (:mod:`.hf_rope`: ``llama3`` and ``linear``),
in both. The training-only ``--hidden-dropout`` (both formats), ``--moe-input-jitter-eps`` and ``--moe-z-loss-coeff``
have no field: the export leaves them out with a warning (``--attention-dropout`` is ``attention_dropout``). What either side cannot express is refused in one line.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..moe.layer_pattern import parse_moe_layer_freq
from .hf import (
    FC1,
    FC2,
    FINAL,
    LAYER,
    PROJ,
    QKV,
    E,
    _base_config,
    _dims,
    _require,
    _silu_rope_theta,
    check_exportable,
    from_hf,
    qkv_to_separate,
    separate_to_qkv,
    to_hf,
    warn_unwritten,
)
from .hf_defaults import with_hf_defaults
from .hf_mixtral import ROUTER, SEQ, _aux_coeff, check_mixtral, expert_matrices, stack_experts
from .hf_rope import rope_scaling_from_hf, rope_scaling_to_hf
from .hf_unused import strip_prefix

QK_NORMS = (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"))  # ours, Qwen3's (under self_attention / self_attn)


def _check_ours(cfg: dict, style: str) -> None:
    _require(cfg.get("qk_layernorm"), f"the {style} format norms queries and keys per head: it needs --qk-layernorm; "
             f"use --hf-style {'mixtral' if style == 'qwen3_moe' else 'llama'}")
    _require(not cfg.get("add_qkv_bias"), f"--add-qkv-bias cannot be expressed in the {style} format (its "
             "attention_bias puts biases on o_proj too)")
    _require(cfg.get("disable_bias_linear"), f"biases (no --disable-bias-linear) cannot be expressed in the {style} "
             "format")


def _attention_fields(hf: dict, layers: int) -> None:
    hf.update(attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=layers,
              layer_types=["full_attention"] * layers)


def _export_norms(sd: dict, out: dict, layers: int) -> None:
    for i in range(layers):
        for ours, theirs in QK_NORMS:
            out[f"model.layers.{i}.self_attn.{theirs}.weight"] = sd[LAYER.format(i=i) + f"self_attention.{ours}.weight"]


def _import_norms(t, sd: dict, layers: int) -> None:
    """Qwen3's q/k norms from ``t`` (names without ``model.``) into our state dict ``sd``."""
    for i in range(layers):
        for ours, theirs in QK_NORMS:
            sd[LAYER.format(i=i) + f"self_attention.{ours}.weight"] = t[f"layers.{i}.self_attn.{theirs}.weight"]


def to_qwen3(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a single-process, unpadded dense state dict ``sd``."""
    _require(not cfg.get("num_experts"), f"--num-experts {cfg.get('num_experts')} (mixture of experts) cannot be "
             "expressed in the qwen3 format; use --hf-style qwen3_moe")
    _check_ours(cfg, "qwen3")
    check_exportable({**cfg, "qk_layernorm": False}, "qwen3")  # the llama layout's refusals, naming this format
    hf, out = to_hf({**cfg, "qk_layernorm": False}, sd, "llama", "qwen3")  # the llama export, then the q/k norms
    layers = _dims(cfg)[0]
    for key in ("mlp_bias", "pretraining_tp"):
        hf.pop(key)
    hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    _attention_fields(hf, layers)
    _export_norms(sd, out, layers)
    return hf, out


def _check_theirs(hf: dict) -> None:
    _require(not hf.get("use_sliding_window") and all(t == "full_attention" for t in hf.get("layer_types") or []),
             "use_sliding_window true (sliding-window layers) cannot be expressed (every layer attends to the whole "
             "causal context); re-save the model with use_sliding_window false")
    _require(not hf.get("attention_bias"), "attention_bias true cannot be expressed (biases on q/k/v and o_proj but "
             "not on the MLP; --add-qkv-bias covers q/k/v only)")


def from_qwen3(hf: dict, hf_sd) -> tuple[dict, dict]:
    """(flat config, single-process unpadded state dict) of a Qwen3 config and its tensors."""
    hf = with_hf_defaults(hf, "qwen3")
    _check_theirs(hf)
    cfg, sd = from_hf({**hf, "model_type": "llama", "attention_bias": False, "mlp_bias": False}, hf_sd, "qwen3")
    cfg["qk_layernorm"] = True
    try:
        _import_norms(strip_prefix(hf_sd, "model."), sd, cfg["num_layers"])
    except KeyError as err:
        raise ConfigError(f"the qwen3 weights have no tensor model.{err.args[0]}; the folder does not match its "
                          "config.json") from None
    return cfg, sd


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE


def to_qwen3_moe(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a single-process, unpadded MoE state dict ``sd``."""
    _check_ours(cfg, "qwen3_moe")
    check_mixtral(cfg, "qwen3_moe", allowed=("qk_layernorm", "moe_router_pre_softmax", "moe_layer_freq"))
    layers, hidden, heads, groups, d = _dims(cfg)
    experts, tied = int(cfg["num_experts"]), not cfg.get("untie_embeddings_and_output_weights", False)
    moe_layers = parse_moe_layer_freq(cfg.get("moe_layer_freq", 1), layers)
    out = {"model.embed_tokens.weight": sd[E + "word_embeddings.weight"], "model.norm.weight": sd[FINAL + "weight"]}
    for i in range(layers):
        src, dst = LAYER.format(i=i), f"model.layers.{i}."
        q, k, v = qkv_to_separate(sd[src + QKV + "weight"], heads, groups, d)
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v, dst + "self_attn.o_proj.weight": sd[src + PROJ + "weight"],
                    dst + "input_layernorm.weight": sd[src + "input_norm.weight"],
                    dst + "post_attention_layernorm.weight": sd[src + "pre_mlp_norm.weight"]})
        pairs = [(dst + f"mlp.experts.{j}.", fc1, fc2) for j, (fc1, fc2) in enumerate(expert_matrices(sd, src, experts))] \
            if moe_layers[i] else [(dst + "mlp.", sd[src + FC1 + "weight"], sd[src + FC2 + "weight"])]
        if moe_layers[i]:
            out[dst + "mlp.gate.weight"] = sd[src + ROUTER]
        for prefix, fc1, fc2 in pairs:
            gate, up = fc1.chunk(2, dim=0)
            out.update({prefix + "gate_proj.weight": gate.contiguous(), prefix + "up_proj.weight": up.contiguous(),
                        prefix + "down_proj.weight": fc2.contiguous()})
    _export_norms(sd, out, layers)
    if not tied:
        out["lm_head.weight"] = sd["output_layer.weight"]
    dtype = str(sd[E + "word_embeddings.weight"].dtype).replace("torch.", "")
    theta = float(cfg.get("rotary_base", 10000))
    rope_parameters, rope_scaling = rope_scaling_to_hf(cfg, theta)
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": int(cfg["vocab_size"]),
          "tie_word_embeddings": tied, "dtype": dtype, "torch_dtype": dtype, "use_cache": True,
          "initializer_range": cfg.get("init_method_std", 0.02), "num_hidden_layers": layers, "hidden_size": hidden,
          "intermediate_size": cfg.get("ffn_hidden_size") or 4 * hidden,
          "moe_intermediate_size": cfg.get("moe_ffn_hidden_size") or cfg.get("ffn_hidden_size") or 4 * hidden,
          "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": d,
          "max_position_embeddings": cfg.get("max_position_embeddings") or cfg.get("seq_length"),
          "rms_norm_eps": cfg.get("norm_epsilon", 1e-5), "rope_theta": theta,
          "rope_parameters": rope_parameters, "hidden_act": "silu",
          "attention_dropout": cfg.get("attention_dropout", 0.0), "num_experts": experts,
          "num_experts_per_tok": int(cfg.get("moe_router_topk", 2)),
          "norm_topk_prob": not cfg.get("moe_router_pre_softmax", False), "decoder_sparse_step": 1,
          "mlp_only_layers": [i for i in range(layers) if not moe_layers[i]], "router_aux_loss_coef": _aux_coeff(cfg),
          "output_router_logits": False}
    if rope_scaling:
        hf["rope_scaling"] = rope_scaling
    _attention_fields(hf, layers)
    warn_unwritten(cfg, "qwen3_moe")
    return hf, out


def _moe_layers(hf: dict) -> list[bool]:
    """Which layers (0-based) are MoE in transformers' rule."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    _require(isinstance(step, int) and step >= 1, f"decoder_sparse_step {step!r} must be a positive integer")
    return [i not in dense and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]


def _qwen3_moe_config(hf: dict) -> dict:
    _check_theirs(hf)
    theta = _silu_rope_theta(hf, 10000.0, scaling=True)  # transformers' default theta (Mixtral's is 1e6)
    scaling = rope_scaling_from_hf(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    moe_layers = _moe_layers(hf)
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # the Hub's name; transformers 5 writes the other
    _require(experts > 0 and any(moe_layers), "a qwen3_moe config without MoE layers (num_experts 0, or every layer in "
             "mlp_only_layers) cannot be expressed here; re-save it as a qwen3 model")
    topk, renorm = hf.get("num_experts_per_tok", 8), hf.get("norm_topk_prob", False)
    _require(topk > 1 or not renorm, "num_experts_per_tok 1 with norm_topk_prob true (every routing weight 1) "
             "cannot be expressed")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    freq = "1" if all(moe_layers) else "[" + ",".join(str(int(m)) for m in moe_layers) + "]"
    return _base_config(
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups, kv_channels=hf.get("head_dim") or hidden // heads,
        ffn_hidden_size=hf["intermediate_size"], max_position_embeddings=hf["max_position_embeddings"],
        position_embedding_type="rope", rotary_base=int(theta), normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True, disable_bias_linear=True, qk_layernorm=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0,
        init_method_std=hf.get("initializer_range", 0.02), vocab_size=hf["vocab_size"], num_experts=experts,
        moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_topk=topk, moe_router_pre_softmax=not renorm,
        moe_layer_freq=freq, moe_router_load_balancing_type=["aux_loss"],
        moe_aux_loss_coeff=[float(hf.get("router_aux_loss_coef", 0.0))], **scaling,
    )


def _moe_layer_state(t, sd: dict, cfg: dict, i: int, moe: bool) -> None:
    """Layer ``i`` of a Qwen3-MoE (names in ``t`` without ``model.``) into our state dict ``sd``."""
    src, dst, a = f"layers.{i}.", LAYER.format(i=i), f"layers.{i}.self_attn."
    _, _, heads, groups, d = _dims(cfg)
    sd[dst + QKV + "weight"] = separate_to_qkv(t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"],
                                               heads, groups, d)
    sd[dst + PROJ + "weight"] = t[a + "o_proj.weight"]
    sd[dst + "input_norm.weight"] = t[src + "input_layernorm.weight"]
    sd[dst + "pre_mlp_norm.weight"] = t[src + "post_attention_layernorm.weight"]
    m = src + "mlp."
    if not moe:
        sd[dst + FC1 + "weight"] = torch.cat([t[m + "gate_proj.weight"], t[m + "up_proj.weight"]])
        sd[dst + FC2 + "weight"] = t[m + "down_proj.weight"]
        return
    sd[dst + ROUTER] = t[m + "gate.weight"]
    for j in range(cfg["num_experts"]):
        e, ours = m + f"experts.{j}.", dst + SEQ.format(j=j)
        sd[ours + "linear_fc1.weight"] = torch.cat([t[e + "gate_proj.weight"], t[e + "up_proj.weight"]])
        sd[ours + "linear_fc2.weight"] = t[e + "down_proj.weight"]


def from_qwen3_moe(hf: dict, hf_sd, grouped: bool = False) -> tuple[dict, dict]:
    """(flat config, single-process unpadded state dict) of a Qwen3-MoE config and tensors; the experts
    in the sequential layout, or stacked for ``--moe-grouped-gemm`` when ``grouped``."""
    hf = with_hf_defaults(hf, "qwen3_moe")
    cfg = _qwen3_moe_config(hf)
    cfg["moe_grouped_gemm"] = grouped
    layers = cfg["num_layers"]
    moe_layers, t = _moe_layers(hf), strip_prefix(hf_sd, "model.")
    try:
        sd = {E + "word_embeddings.weight": t["embed_tokens.weight"], FINAL + "weight": t["norm.weight"]}
        for i in range(layers):
            _moe_layer_state(t, sd, cfg, i, moe_layers[i])
        _import_norms(t, sd, layers)
    except KeyError as err:
        raise ConfigError(f"the qwen3_moe weights have no tensor model.{err.args[0]}; the folder does not match its "
                          "config.json (only the per-expert gate_proj/up_proj/down_proj layout is read)") from None
    if cfg["untie_embeddings_and_output_weights"]:
        _require("lm_head.weight" in hf_sd, "tie_word_embeddings is false but the weights have no lm_head.weight")
        sd["output_layer.weight"] = hf_sd["lm_head.weight"]
    if grouped:
        for i in range(layers):
            if moe_layers[i]:
                stack_experts(sd, LAYER.format(i=i), cfg["num_experts"])
    return cfg, {k: v.contiguous() for k, v in sd.items()}
