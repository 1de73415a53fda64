"""Hugging Face ``transformers`` formats <-> megatron_lite's single-process GPT weights.

Two styles, picked from the model's position embedding (``--hf-style auto``):

* ``gpt2`` (``GPT2LMHeadModel``): learned absolute positions, LayerNorm, GeLU MLP, biases, multi-head
  attention. HF's Conv1D stores matrices ``[in, out]``, so every matrix is transposed, and its fused
  ``c_attn`` is ``[Q; K; V]`` (all heads of Q, then K, then V) while ours is per head
  ``[q_h; k_h; v_h]``. GeLU: our exact (erf) form is HF's ``activation_function: "gelu"``, the tanh
  approximation (``--openai-gelu``, or the fused bias + GeLU of ``--bias-gelu-fusion``, Megatron's
  default) is ``"gelu_new"`` (``"gelu_pytorch_tanh"`` is the same formula);
  other activations are refused.
* ``llama`` (``LlamaForCausalLM``): rotary embeddings (``rope_theta``), RMSNorm, SwiGLU, grouped-query
  attention, no biases (or biases on every linear: ``attention_bias`` + ``mlp_bias``), tied or untied.
  Our fused QKV ``[groups, (heads_per_group + 2) * head_dim, hidden]`` is split into q/k/v_proj per
  group, and fc1 ``[gate; up]`` into gate_proj/up_proj. HF's rotary uses the same rotate-half layout.

More styles live in their own modules: ``mixtral`` (:mod:`~megatron_lite.checkpoint.hf_mixtral`,
picked for mixture-of-experts models), ``bert`` (:mod:`~megatron_lite.checkpoint.hf_bert`, for BERT),
``deepseek_v3`` (:mod:`~megatron_lite.checkpoint.hf_deepseek`, picked for multi-latent attention or
multi-token prediction), ``qwen2`` and ``qwen3`` / ``qwen3_moe`` (:mod:`~megatron_lite.checkpoint.hf_qwen3`,
picked for ``--qk-layernorm``), ``gpt_oss`` (:mod:`~megatron_lite.checkpoint.hf_gptoss`, picked for MoE models
with ``--quick-geglu`` or attention sinks).
A model the target style cannot express is refused with one line naming the option that differs.
Options that act in training only and that a format has no field for (``--hidden-dropout`` from llama on,
``--moe-input-jitter-eps`` / ``--moe-z-loss-coeff``) are left out with one warning naming them;
``--attention-dropout`` is every format's attention dropout field.
Vocabulary tensors have exactly ``vocab_size`` rows on both sides (the bundle is unpadded).
"""

from __future__ import annotations

import logging

import torch

from ..config import Config
from ..errors import ConfigError
from ..fusions.config import tanh_gelu
from .hf_defaults import with_hf_defaults
from .hf_rope import rope_scaling_from_hf, rope_scaling_to_hf
from .hf_unused import strip_prefix

STYLES = ("auto", "gpt2", "llama", "mixtral", "bert", "deepseek_v3", "qwen2", "qwen3", "qwen3_moe", "mistral",
          "gpt_oss")
# from mixtral on in hf_<name>.py (qwen3_moe in hf_qwen3.py)
# HF GPT-2 activation_function -> our --openai-gelu
GPT2_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
E, LAYER, FINAL = "embedding.", "decoder.layers.{i}.", "decoder.final_norm."
QKV, PROJ = "self_attention.linear_qkv.", "self_attention.linear_proj."
FC1, FC2 = "mlp.linear_fc1.", "mlp.linear_fc2."
# options that act in training only (the trained model computes the same without them) and that the formats from
# llama on have no field for (gpt2 and bert have dropout fields; mixtral's router_jitter_noise is the jitter)
TRAINING_ONLY = (("hidden_dropout", "--hidden-dropout"), ("moe_input_jitter_eps", "--moe-input-jitter-eps"),
                 ("moe_z_loss_coeff", "--moe-z-loss-coeff"))
log = logging.getLogger(__name__)


def _require(cond, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def pick_style(cfg: dict, style: str = "auto") -> str:
    bert = "bert_no_binary_head" in cfg  # saved by pretrain_bert.py (before DeepSeek: a BERT with MLA is a BERT)
    if bert or style == "bert":
        _require(bert and style in ("auto", "bert"), f"--hf-style {style}: a {'BERT' if bert else 'GPT'} model is "
                 f"exported with --hf-style {'bert' if bert else 'auto'}")
        return "bert"
    deepseek = next((f for f in ("multi_latent_attention", "mtp_num_layers") if cfg.get(f)), None)
    if deepseek and style in ("auto", "deepseek_v3"):
        return "deepseek_v3"
    _require(not deepseek, f"--{str(deepseek).replace('_', '-')} cannot be expressed in the {style} format; use "
             "--hf-style deepseek_v3")
    if style == "auto":
        if cfg.get("num_experts") and (cfg.get("quick_geglu") or cfg.get("softmax_type", "vanilla") != "vanilla"):
            return "gpt_oss"
        if cfg.get("qk_layernorm"):
            return "qwen3_moe" if cfg.get("num_experts") else "qwen3"
        if cfg.get("num_experts"):
            return "mixtral"
        if cfg.get("position_embedding_type") != "rope":
            return "gpt2"
        if cfg.get("add_qkv_bias") and cfg.get("disable_bias_linear"):
            return "qwen2"
        return "mistral" if tuple(cfg.get("window_size") or (-1, -1)) != (-1, -1) else "llama"
    _require(style in STYLES, f"--hf-style {style!r} is not one of {', '.join(STYLES)}")
    return style


def warn_unwritten(cfg: dict, style: str, written: tuple = ()) -> None:
    """One warning naming the TRAINING_ONLY options set in ``cfg`` (but those in ``written``) that the ``style``
    format has no field for: the export computes the same model, a fine-tune of it must set them again."""
    used = [f"{flag} {cfg[name]:g}" for name, flag in TRAINING_ONLY if name not in written and cfg.get(name)]
    if used:
        log.warning("%s: training-only, and the %s format has no field for it; not written (the exported model "
                    "computes the same; give it again to fine-tune the export)", ", ".join(used), style)


def _dims(cfg: dict) -> tuple[int, int, int, int, int]:
    """(layers, hidden, heads, groups, head_dim) with the defaults filled."""
    heads = cfg["num_attention_heads"]
    return (cfg["num_layers"], cfg["hidden_size"], heads, cfg.get("num_query_groups") or heads,
            cfg.get("kv_channels") or cfg["hidden_size"] // heads)


def check_exportable(cfg: dict, style: str) -> None:
    """Raise one ConfigError naming the option the ``style`` format cannot express."""
    _, hidden, heads, groups, head_dim = _dims(cfg)
    _require(not cfg.get("num_experts"), f"--num-experts {cfg.get('num_experts')} (mixture of experts) cannot be "
             f"expressed in the {style} format; use --hf-style {'qwen3_moe' if cfg.get('qk_layernorm') else 'mixtral'}")
    _require(not cfg.get("qk_layernorm"), f"--qk-layernorm (per-head query/key norms) cannot be expressed in the "
             f"{style} format; use --hf-style qwen3")
    if style == "gpt2":
        _require(cfg.get("position_embedding_type", "learned_absolute") == "learned_absolute",
                 "--position-embedding-type rope cannot be expressed in the gpt2 format; use --hf-style llama")
        _require(cfg.get("normalization", "LayerNorm") == "LayerNorm",
                 "--normalization RMSNorm cannot be expressed in the gpt2 format (LayerNorm only); use --hf-style llama")
        _require(not cfg.get("swiglu"), "--swiglu cannot be expressed in the gpt2 format (GeLU MLP only)")
        _require(not cfg.get("disable_bias_linear"), "--disable-bias-linear cannot be expressed in the gpt2 format "
                 "(it always has biases)")
        _require(groups == heads, f"--num-query-groups {groups} (grouped-query attention) cannot be expressed in the "
                 "gpt2 format; use --hf-style llama")
        _require(head_dim * heads == hidden, f"--kv-channels {head_dim} cannot be expressed in the gpt2 format "
                 "(head size is hidden-size / num-attention-heads)")
    else:  # the llama layout (also qwen2's and qwen3's): the gpt2 format is the way out for llama only (it has
        gpt2 = "; use --hf-style gpt2" if style == "llama" else ""  # neither q/k-only biases nor q/k norms)
        _require(cfg.get("position_embedding_type") == "rope", "--position-embedding-type learned_absolute cannot "
                 f"be expressed in the {style} format (rotary only){gpt2}")
        _require(cfg.get("normalization") == "RMSNorm", f"--normalization LayerNorm cannot be expressed in the {style} "
                 f"format (RMSNorm only){gpt2}")
        _require(cfg.get("swiglu"), f"a GeLU MLP (no --swiglu) cannot be expressed in the {style} format (SwiGLU only)")
        _require(style == "qwen2" or not (cfg.get("add_qkv_bias") and cfg.get("disable_bias_linear")),
                 "--add-qkv-bias with --disable-bias-linear (biases on q/k/v only) cannot be expressed in the llama "
                 "format; use --hf-style qwen2")
        _require(cfg.get("rotary_percent", 1.0) == 1.0, f"--rotary-percent {cfg.get('rotary_percent')} cannot be "
                 f"expressed in the {style} format (every channel of a head rotates)")


# ---------------------------------------------------------------------------------------------
# Fused QKV layouts.


def qkv_to_separate(w: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Our fused ``[groups * (r + 2) * d, ...]`` -> (q ``[heads * d, ...]``, k, v ``[groups * d, ...]``)."""
    r, rest = heads // groups, w.shape[1:]
    x = w.reshape(groups, (r + 2) * head_dim, *rest)
    q, k, v = x[:, : r * head_dim], x[:, r * head_dim:(r + 1) * head_dim], x[:, (r + 1) * head_dim:]
    return (q.reshape(heads * head_dim, *rest).contiguous(), k.reshape(groups * head_dim, *rest).contiguous(),
            v.reshape(groups * head_dim, *rest).contiguous())


def separate_to_qkv(q, k, v, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`qkv_to_separate`."""
    r, rest = heads // groups, q.shape[1:]
    return torch.cat([q.reshape(groups, r * head_dim, *rest), k.reshape(groups, head_dim, *rest),
                      v.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest).contiguous()


# ---------------------------------------------------------------------------------------------
# Export.


def _gpt2_tensors(sd: dict, cfg: dict, tied: bool) -> dict:
    layers, _, heads, groups, d = _dims(cfg)
    out = {"transformer.wte.weight": sd[E + "word_embeddings.weight"],
           "transformer.wpe.weight": sd[E + "position_embeddings.weight"]}
    for i in range(layers):
        src, dst = LAYER.format(i=i), f"transformer.h.{i}."
        q, k, v = qkv_to_separate(sd[src + QKV + "weight"], heads, groups, d)
        qb, kb, vb = qkv_to_separate(sd[src + QKV + "bias"], heads, groups, d)
        out.update({
            dst + "ln_1.weight": sd[src + "input_norm.weight"], dst + "ln_1.bias": sd[src + "input_norm.bias"],
            dst + "attn.c_attn.weight": torch.cat([q, k, v]).t(), dst + "attn.c_attn.bias": torch.cat([qb, kb, vb]),
            dst + "attn.c_proj.weight": sd[src + PROJ + "weight"].t(), dst + "attn.c_proj.bias": sd[src + PROJ + "bias"],
            dst + "ln_2.weight": sd[src + "pre_mlp_norm.weight"], dst + "ln_2.bias": sd[src + "pre_mlp_norm.bias"],
            dst + "mlp.c_fc.weight": sd[src + FC1 + "weight"].t(), dst + "mlp.c_fc.bias": sd[src + FC1 + "bias"],
            dst + "mlp.c_proj.weight": sd[src + FC2 + "weight"].t(), dst + "mlp.c_proj.bias": sd[src + FC2 + "bias"],
        })
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = sd[FINAL + "weight"], sd[FINAL + "bias"]
    if not tied:
        out["lm_head.weight"] = sd["output_layer.weight"]
    return out


def _llama_tensors(sd: dict, cfg: dict, tied: bool, bias: bool) -> dict:
    layers, _, heads, groups, d = _dims(cfg)
    out = {"model.embed_tokens.weight": sd[E + "word_embeddings.weight"]}
    for i in range(layers):
        src, dst = LAYER.format(i=i), f"model.layers.{i}."
        kinds = ("weight", "bias") if bias else ("weight",)
        for kind in kinds:
            q, k, v = qkv_to_separate(sd[src + QKV + kind], heads, groups, d)
            gate, up = sd[src + FC1 + kind].chunk(2, dim=0)
            out.update({
                dst + f"self_attn.q_proj.{kind}": q, dst + f"self_attn.k_proj.{kind}": k,
                dst + f"self_attn.v_proj.{kind}": v, dst + f"self_attn.o_proj.{kind}": sd[src + PROJ + kind],
                dst + f"mlp.gate_proj.{kind}": gate.contiguous(), dst + f"mlp.up_proj.{kind}": up.contiguous(),
                dst + f"mlp.down_proj.{kind}": sd[src + FC2 + kind],
            })
        out[dst + "input_layernorm.weight"] = sd[src + "input_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_norm.weight"]
    out["model.norm.weight"] = sd[FINAL + "weight"]
    if not tied:
        out["lm_head.weight"] = sd["output_layer.weight"]
    return out


def to_hf(cfg: dict, sd: dict, style: str, family: str | None = None) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a single-process, unpadded state dict ``sd``; ``family``: the
    format a warning names (qwen2, qwen3 and mistral are written as llama)."""
    check_exportable(cfg, style)
    layers, hidden, heads, groups, d = _dims(cfg)
    tied = not cfg.get("untie_embeddings_and_output_weights", False)
    dtype = str(sd[E + "word_embeddings.weight"].dtype).replace("torch.", "")
    common = {"vocab_size": int(cfg["vocab_size"]), "tie_word_embeddings": tied, "dtype": dtype, "torch_dtype": dtype,
              "initializer_range": cfg.get("init_method_std", 0.02), "use_cache": True}
    ffn = cfg.get("ffn_hidden_size") or 4 * hidden
    max_pos = cfg.get("max_position_embeddings") or cfg.get("seq_length")
    if style == "gpt2":
        hf = {**common, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": layers, "n_embd": hidden,
              "n_head": heads, "n_inner": ffn, "n_positions": max_pos,
              "activation_function": "gelu_new" if tanh_gelu(cfg) else "gelu",
              "layer_norm_epsilon": cfg.get("norm_epsilon", 1e-5), "attn_pdrop": cfg.get("attention_dropout", 0.1),
              "resid_pdrop": cfg.get("hidden_dropout", 0.1), "embd_pdrop": cfg.get("hidden_dropout", 0.1),
              "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
        return hf, _gpt2_tensors(sd, cfg, tied)
    bias = not cfg.get("disable_bias_linear", False)
    theta = float(cfg.get("rotary_base", 10000))
    hf = {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
          "hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": groups,
          "head_dim": d, "max_position_embeddings": max_pos, "rms_norm_eps": cfg.get("norm_epsilon", 1e-5),
          "rope_theta": theta, "rope_parameters": rope_scaling_to_hf(cfg, theta)[0], "hidden_act": "silu",
          "attention_bias": bias, "mlp_bias": bias, "attention_dropout": cfg.get("attention_dropout", 0.0),
          "pretraining_tp": 1}
    if rope_scaling_to_hf(cfg, theta)[1]:
        hf["rope_scaling"] = rope_scaling_to_hf(cfg, theta)[1]
    warn_unwritten(cfg, family or style)
    return hf, _llama_tensors(sd, cfg, tied, bias)


# ---------------------------------------------------------------------------------------------
# Import.


def _base_config(**model) -> dict:
    """A flat config (every run option at its default) with these model fields."""
    cfg = Config().flat()
    cfg.update(model)
    cfg["padded_vocab_size"] = None
    cfg["seq_length"] = model["max_position_embeddings"]
    return cfg


def _gpt2_config(hf: dict) -> dict:
    act = hf.get("activation_function", "gelu_new")
    _require(act in GPT2_ACTIVATIONS, f"activation_function {act!r} cannot be expressed: the MLP's GeLU is exact "
             "('gelu') or tanh-approximated ('gelu_new', --openai-gelu)")
    _require(not hf.get("scale_attn_by_inverse_layer_idx") and hf.get("scale_attn_weights", True),
             "scale_attn_by_inverse_layer_idx / scale_attn_weights false cannot be expressed: attention is scaled "
             "by 1/sqrt(head size)")
    _require(not hf.get("add_cross_attention"), "add_cross_attention cannot be expressed (decoder-only GPT)")
    hidden, heads = hf["n_embd"], hf["n_head"]
    return _base_config(
        num_layers=hf["n_layer"], hidden_size=hidden, num_attention_heads=heads, num_query_groups=heads,
        kv_channels=hidden // heads, ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        max_position_embeddings=hf["n_positions"], position_embedding_type="learned_absolute",
        normalization="LayerNorm", norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), swiglu=False,
        openai_gelu=GPT2_ACTIVATIONS[act], bias_gelu_fusion=GPT2_ACTIVATIONS[act],  # the fused GeLU is tanh
        disable_bias_linear=False, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
        attention_dropout=hf.get("attn_pdrop", 0.1), hidden_dropout=hf.get("resid_pdrop", 0.1),
        init_method_std=hf.get("initializer_range", 0.02), vocab_size=hf["vocab_size"],
    )


def _silu_rope_theta(hf: dict, default_theta: float, scaling: bool = False) -> float:
    """Check a SwiGLU + RoPE config (llama and mixtral styles; ``scaling``: llama3 / linear RoPE
    scaling allowed, see :mod:`.hf_rope`) and return its RoPE theta."""
    _require(hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r} cannot be expressed "
             "(SwiGLU uses silu)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    _require(scaling or rope.get("rope_type", rope.get("type", "default")) == "default",
             f"rope_type {rope.get('rope_type', rope.get('type'))!r} (RoPE scaling) cannot be expressed; only plain RoPE")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", default_theta)))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    _require(partial == 1.0, f"partial_rotary_factor {partial} cannot be expressed (the llama-style attention of "
             "transformers rotates every channel of a head)")
    _require(theta == int(theta), f"rope_theta {theta} cannot be expressed (--rotary-base is an integer)")
    return theta


def _llama_config(hf: dict) -> dict:
    theta = _silu_rope_theta(hf, 10000.0, scaling=True)
    scaling = rope_scaling_from_hf(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    _require(hf.get("pretraining_tp", 1) == 1, "pretraining_tp > 1 cannot be expressed; re-save the model with 1")
    bias = bool(hf.get("attention_bias", False))
    _require(bool(hf.get("mlp_bias", False)) == bias, "attention_bias and mlp_bias differ; cannot be expressed "
             "(--disable-bias-linear applies to every linear layer)")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    return _base_config(
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=hf.get("head_dim") or hidden // heads, ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"], position_embedding_type="rope", rotary_base=int(theta),
        normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True, disable_bias_linear=not bias,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0,
        init_method_std=hf.get("initializer_range", 0.02), vocab_size=hf["vocab_size"], **scaling,
    )


def _gpt2_state(hf_sd: dict, cfg: dict) -> dict:
    layers, _, heads, groups, d = _dims(cfg)
    t = strip_prefix(hf_sd, "transformer.")
    sd = {E + "word_embeddings.weight": t["wte.weight"], E + "position_embeddings.weight": t["wpe.weight"]}
    hidden = cfg["hidden_size"]
    for i in range(layers):
        src, dst = f"h.{i}.", LAYER.format(i=i)
        q, k, v = t[src + "attn.c_attn.weight"].t().split(hidden)
        qb, kb, vb = t[src + "attn.c_attn.bias"].split(hidden)
        sd.update({
            dst + "input_norm.weight": t[src + "ln_1.weight"], dst + "input_norm.bias": t[src + "ln_1.bias"],
            dst + QKV + "weight": separate_to_qkv(q, k, v, heads, groups, d),
            dst + QKV + "bias": separate_to_qkv(qb, kb, vb, heads, groups, d),
            dst + PROJ + "weight": t[src + "attn.c_proj.weight"].t(), dst + PROJ + "bias": t[src + "attn.c_proj.bias"],
            dst + "pre_mlp_norm.weight": t[src + "ln_2.weight"], dst + "pre_mlp_norm.bias": t[src + "ln_2.bias"],
            dst + FC1 + "weight": t[src + "mlp.c_fc.weight"].t(), dst + FC1 + "bias": t[src + "mlp.c_fc.bias"],
            dst + FC2 + "weight": t[src + "mlp.c_proj.weight"].t(), dst + FC2 + "bias": t[src + "mlp.c_proj.bias"],
        })
    sd[FINAL + "weight"], sd[FINAL + "bias"] = t["ln_f.weight"], t["ln_f.bias"]
    return sd


def _llama_state(hf_sd: dict, cfg: dict) -> dict:
    layers, _, heads, groups, d = _dims(cfg)
    t = strip_prefix(hf_sd, "model.")
    sd = {E + "word_embeddings.weight": t["embed_tokens.weight"]}
    kinds = ("weight",) if cfg["disable_bias_linear"] else ("weight", "bias")
    for i in range(layers):
        src, dst = f"layers.{i}.", LAYER.format(i=i)
        for kind in kinds:
            a, m = src + "self_attn.", src + "mlp."
            sd[dst + QKV + kind] = separate_to_qkv(t[a + f"q_proj.{kind}"], t[a + f"k_proj.{kind}"],
                                                   t[a + f"v_proj.{kind}"], heads, groups, d)
            sd[dst + PROJ + kind] = t[a + f"o_proj.{kind}"]
            sd[dst + FC1 + kind] = torch.cat([t[m + f"gate_proj.{kind}"], t[m + f"up_proj.{kind}"]])
            sd[dst + FC2 + kind] = t[m + f"down_proj.{kind}"]
        sd[dst + "input_norm.weight"] = t[src + "input_layernorm.weight"]
        sd[dst + "pre_mlp_norm.weight"] = t[src + "post_attention_layernorm.weight"]
    sd[FINAL + "weight"] = t["norm.weight"]
    return sd


def from_hf(hf: dict, hf_sd: dict, family: str | None = None) -> tuple[dict, dict]:
    """(flat config, single-process unpadded state dict) of a Hugging Face config and its tensors;
    ``family``: the format a refusal names (qwen2 and qwen3 are read as llama)."""
    kind = hf.get("model_type")
    hf = with_hf_defaults(hf, kind)
    _require(kind in ("gpt2", "llama"), f"model_type {kind!r} cannot be imported; supported: gpt2, llama, qwen2, "
             "qwen3, qwen3_moe, mistral, mixtral, gpt_oss, megatron-bert, deepseek_v3")
    cfg = _gpt2_config(hf) if kind == "gpt2" else _llama_config(hf)
    try:
        sd = _gpt2_state(hf_sd, cfg) if kind == "gpt2" else _llama_state(hf_sd, cfg)
    except KeyError as err:  # named as in the files (the readers strip the prefix)
        prefix = "transformer." if kind == "gpt2" else "model."
        prefix = prefix if any(k.startswith(prefix) for k in hf_sd) else ""
        raise ConfigError(f"the {family or kind} weights have no tensor {prefix}{err.args[0]}; the folder does not match "
                          "its config.json") from None
    if cfg["untie_embeddings_and_output_weights"]:
        _require("lm_head.weight" in hf_sd, "tie_word_embeddings is false but the weights have no lm_head.weight")
        sd["output_layer.weight"] = hf_sd["lm_head.weight"]
    return cfg, {k: v.contiguous() for k, v in sd.items()}
