"""Hugging Face ``gpt_oss`` (``GptOssForCausalLM``) <-> megatron_lite's single-process mixture-of-experts GPT weights.

gpt-oss is the llama layout (RMSNorm, grouped-query attention, ``head_dim``: our ``--kv-channels``,
tied or untied) with, in our flags:

* biases on q/k/v/o, on the router and on every expert (``attention_bias: true``; without
  ``--disable-bias-linear``: our router's ``mlp.router.bias``, as in Megatron-LM);
* a learnable attention sink per head, ``self_attn.sinks`` [heads]: ``--softmax-type learnable``,
  ``self_attention.core_attention.softmax_offset`` (``off-by-one`` exports as sinks of zero);
* sliding-window layers (``layer_types``, ``sliding_window``): ``--window-size W-1 0`` with
  ``--window-attn-skip-freq`` a 0/1 list (1 = window; :mod:`.hf_mistral`);
* YaRN rotary scaling of the whole head: ``--rope-type yarn`` (``truncate: false``, gpt-oss's, is
  ``--no-yarn-correction-range-round-to-int``; :mod:`.hf_deepseek_rope`), or plain RoPE;
* experts with the clamped SwiGLU ``(clamp(up, -L, L) + 1) * g sigmoid(1.702 g)``, ``g = clamp(gate, max=L)``:
  ``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value L`` (``swiglu_limit``; ``swiglu_alpha``
  must be 1.702). transformers stores the experts stacked, ``gate_up_proj`` ``[E, h, 2 ffn]`` with gate
  and up in alternating columns (gate even, up odd) and ``down_proj`` ``[E, ffn, h]`` (``x @ W``); our
  fc1 is ``[gate; up]`` ``[2 ffn, h]`` (``weight1`` ``[E, h, 2 ffn]`` for --moe-grouped-gemm), fc2 ``[h, ffn]``.
  The routing (top-k of the logits, softmax over those k) is our default post-top-k softmax.

``--hidden-dropout``, ``--moe-input-jitter-eps`` and ``--moe-z-loss-coeff`` act in training only and have no
gpt_oss field: the export leaves them out with a warning (``--attention-dropout`` is ``attention_dropout``).
``--use-rope-scaling`` and ``--rotary-seq-len-interpolation-factor`` are refused.

MXFP4-quantized folders (``quantization_config``, ``*_blocks`` / ``*_scales`` tensors) are refused:
load them in transformers with ``Mxfp4Config(dequantize=True)`` and ``save_pretrained`` first.
"""

from __future__ import annotations

import torch

from ..activations import QUICK_GELU_ALPHA
from ..errors import ConfigError
from .hf import (
    FINAL,
    LAYER,
    PROJ,
    QKV,
    E,
    _base_config,
    _dims,
    _require,
    qkv_to_separate,
    separate_to_qkv,
    warn_unwritten,
)
from .hf_deepseek_rope import rope_from_hf, rope_to_hf
from .hf_defaults import with_hf_defaults
from .hf_mistral import hf_window, window_from_hf
from .hf_mixtral import ROUTER, SEQ, _aux_coeff, check_mixtral
from .hf_rope import interpolation_factor
from .hf_unused import strip_prefix

SINK = "self_attention.core_attention.softmax_offset"
ROUTER_BIAS = "mlp.router.bias"
DEFAULT_THETA = 150000.0  # transformers' GptOssConfig.default_theta
# the Mixtral refusals gpt-oss does not share (it has biases everywhere, so --add-qkv-bias changes nothing)
_ALLOWED = ("add_qkv_bias", "swiglu", "disable_bias_linear")


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """transformers' ``gate_up`` layout (last dim: gate, up, gate, up, ...) of the two halves."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Our ``[gate; up]`` along the last dim of transformers' interleaved ``gate_up``."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def check_gptoss(cfg: dict) -> None:
    """Raise one ConfigError naming the first option the gpt_oss format cannot express."""
    check_mixtral(cfg, "gpt_oss", allowed=_ALLOWED)
    clamp = cfg.get("activation_func_clamp_value")
    for ok, words in ((cfg.get("quick_geglu"), "its experts' MLP is --quick-geglu (not --swiglu / GeLU)"),
                      (cfg.get("glu_linear_offset") == 1.0, f"--glu-linear-offset {cfg.get('glu_linear_offset')} "
                       "differs (gpt-oss adds 1 to the linear half)"),
                      (clamp is not None, "it clamps the gated unit: give --activation-func-clamp-value (gpt-oss: 7)"),
                      (not cfg.get("disable_bias_linear"), "it has biases on every linear layer (drop "
                       "--disable-bias-linear)"),
                      (cfg.get("softmax_type") in ("learnable", "off-by-one"), "it has attention sinks: "
                       "--softmax-type learnable")):
        _require(ok, f"the gpt_oss format cannot express this model: {words}")
    hf_window(cfg, "gpt_oss")  # a causal window of the last N tokens only
    for flag, value in (("--use-rope-scaling", cfg.get("use_rope_scaling")),
                        ("--rotary-seq-len-interpolation-factor", interpolation_factor(cfg))):
        _require(not value, f"{flag} cannot be expressed in the gpt_oss format (plain RoPE or YaRN: --rope-type yarn)")


def _expert_tensors(sd: dict, src: str, experts: int) -> dict:
    """transformers' stacked expert tensors (names under ``mlp.experts.``) of our layer ``src``."""
    if src + "mlp.experts.weight1" in sd:
        w1, b1 = sd[src + "mlp.experts.weight1"], sd[src + "mlp.experts.bias1"]
        w2, b2 = sd[src + "mlp.experts.weight2"], sd[src + "mlp.experts.bias2"]
    else:
        e = [src + SEQ.format(j=j) for j in range(experts)]
        w1 = torch.stack([sd[p + "linear_fc1.weight"].t() for p in e])
        b1 = torch.stack([sd[p + "linear_fc1.bias"] for p in e])
        w2 = torch.stack([sd[p + "linear_fc2.weight"].t() for p in e])
        b2 = torch.stack([sd[p + "linear_fc2.bias"] for p in e])
    return {"gate_up_proj": interleave(*w1.chunk(2, dim=-1)), "gate_up_proj_bias": interleave(*b1.chunk(2, dim=-1)),
            "down_proj": w2, "down_proj_bias": b2}


def _rope_parameters(cfg: dict) -> dict:
    theta = float(cfg.get("rotary_base", 10000))
    if cfg.get("rope_type") != "yarn":
        return {"rope_type": "default", "rope_theta": theta}
    params = rope_to_hf(cfg)[0]
    params["truncate"] = bool(cfg.get("yarn_correction_range_round_to_int", True))
    return params


def to_gptoss(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a single-process, unpadded MoE state dict ``sd``."""
    check_gptoss(cfg)
    layers, hidden, heads, groups, d = _dims(cfg)
    experts, tied = int(cfg["num_experts"]), not cfg.get("untie_embeddings_and_output_weights", False)
    out = {"model.embed_tokens.weight": sd[E + "word_embeddings.weight"], "model.norm.weight": sd[FINAL + "weight"]}
    for i in range(layers):
        src, dst = LAYER.format(i=i), f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = qkv_to_separate(sd[src + QKV + kind], heads, groups, d)
            out.update({dst + f"self_attn.q_proj.{kind}": q, dst + f"self_attn.k_proj.{kind}": k,
                        dst + f"self_attn.v_proj.{kind}": v, dst + f"self_attn.o_proj.{kind}": sd[src + PROJ + kind]})
        sink = sd.get(src + SINK)
        out.update({dst + "self_attn.sinks": torch.zeros(heads, dtype=sd[src + ROUTER].dtype) if sink is None else sink,
                    dst + "input_layernorm.weight": sd[src + "input_norm.weight"],
                    dst + "post_attention_layernorm.weight": sd[src + "pre_mlp_norm.weight"],
                    dst + "mlp.router.weight": sd[src + ROUTER], dst + "mlp.router.bias": sd[src + ROUTER_BIAS]})
        out.update({dst + "mlp.experts." + k: v.contiguous() for k, v in _expert_tensors(sd, src, experts).items()})
    if not tied:
        out["lm_head.weight"] = sd["output_layer.weight"]
    window, windowed = hf_window(cfg, "gpt_oss")
    max_pos = cfg.get("max_position_embeddings") or cfg.get("seq_length")
    window = window or max_pos  # unused by full layers, but transformers builds the window mask all the same
    dtype = str(sd[E + "word_embeddings.weight"].dtype).replace("torch.", "")
    ffn = cfg.get("moe_ffn_hidden_size") or cfg.get("ffn_hidden_size") or 4 * hidden
    hf = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": int(cfg["vocab_size"]),
          "tie_word_embeddings": tied, "dtype": dtype, "torch_dtype": dtype, "use_cache": True,
          "initializer_range": cfg.get("init_method_std", 0.02), "num_hidden_layers": layers, "hidden_size": hidden,
          "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": d,
          "max_position_embeddings": max_pos, "rms_norm_eps": cfg.get("norm_epsilon", 1e-5),
          "rope_parameters": _rope_parameters(cfg),
          "sliding_window": window, "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
          "attention_bias": True, "attention_dropout": cfg.get("attention_dropout", 0.0), "hidden_act": "silu",
          "num_local_experts": experts, "num_experts_per_tok": int(cfg.get("moe_router_topk", 2)),
          "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": float(cfg["activation_func_clamp_value"]),
          "router_aux_loss_coef": _aux_coeff(cfg), "output_router_logits": False}
    warn_unwritten(cfg, "gpt_oss")
    return hf, out


def _check_theirs(hf: dict) -> None:
    _require(not hf.get("quantization_config"), "the gpt_oss folder is quantized (quantization_config, MXFP4 "
             "experts); load it in transformers with Mxfp4Config(dequantize=True), save_pretrained, and import that")
    _require(hf.get("attention_bias", True), "attention_bias false cannot be expressed (the gpt_oss router and "
             "experts always have biases, and --disable-bias-linear applies to every linear layer)")
    alpha = float(hf.get("swiglu_alpha", QUICK_GELU_ALPHA))
    _require(alpha == QUICK_GELU_ALPHA, f"swiglu_alpha {alpha} cannot be expressed (--quick-geglu's sigmoid gain is "
             f"{QUICK_GELU_ALPHA})")
    limit = hf.get("swiglu_limit", 7.0)
    _require(limit is not None and float(limit) > 0, f"swiglu_limit {limit} cannot be expressed "
             "(--activation-func-clamp-value is a positive number)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    _require(rope.get("partial_rotary_factor", 1.0) == 1.0, "partial_rotary_factor cannot be expressed (gpt-oss "
             "rotates every channel of a head)")


def windowed_layers(hf: dict) -> list[bool]:
    """Which layers use the sliding window (``layer_types``; transformers' default alternates, from sliding)."""
    layers, types = hf["num_hidden_layers"], hf.get("layer_types")
    if types is None:
        return [i % 2 == 0 for i in range(layers)]
    _require(len(types) == layers and set(types) <= {"sliding_attention", "full_attention"},
             f"layer_types {types} must name full_attention or sliding_attention for each of the {layers} layers")
    return [t == "sliding_attention" for t in types]


def _gptoss_config(hf: dict) -> dict:
    _check_theirs(hf)
    hidden, heads, ffn = hf["hidden_size"], hf["num_attention_heads"], hf["intermediate_size"]
    groups = hf.get("num_key_value_heads") or heads
    rope = rope_from_hf({**hf, "rope_theta": hf.get("rope_theta", DEFAULT_THETA)})
    return _base_config(
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups, kv_channels=hf.get("head_dim") or hidden // heads,
        ffn_hidden_size=ffn, max_position_embeddings=hf["max_position_embeddings"], position_embedding_type="rope",
        normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-5), swiglu=False, quick_geglu=True,
        glu_linear_offset=1.0, activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
        disable_bias_linear=False, softmax_type="learnable",
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0,
        init_method_std=hf.get("initializer_range", 0.02), vocab_size=hf["vocab_size"],
        num_experts=hf["num_local_experts"], moe_ffn_hidden_size=ffn, moe_router_topk=hf.get("num_experts_per_tok", 4),
        moe_layer_freq="1", moe_router_load_balancing_type=["aux_loss"],
        moe_aux_loss_coeff=[float(hf.get("router_aux_loss_coef", 0.0))],
        **window_from_hf(hf.get("sliding_window"), windowed_layers(hf)), **rope,
    )


def _experts_state(t, m: str, dst: str, experts: int, grouped: bool) -> dict:
    """Our expert tensors of transformers' stacked ``m + gate_up_proj`` etc. (names without ``model.``)."""
    w1, b1 = deinterleave(t[m + "gate_up_proj"]), deinterleave(t[m + "gate_up_proj_bias"])
    w2, b2 = t[m + "down_proj"], t[m + "down_proj_bias"]
    if grouped:
        return {dst + "mlp.experts.weight1": w1, dst + "mlp.experts.bias1": b1,
                dst + "mlp.experts.weight2": w2, dst + "mlp.experts.bias2": b2}
    out = {}
    for j in range(experts):
        e = dst + SEQ.format(j=j)
        out.update({e + "linear_fc1.weight": w1[j].t(), e + "linear_fc1.bias": b1[j],
                    e + "linear_fc2.weight": w2[j].t(), e + "linear_fc2.bias": b2[j]})
    return out


def _layer_state(t, cfg: dict, i: int, grouped: bool) -> dict:
    src, dst, a = f"layers.{i}.", LAYER.format(i=i), f"layers.{i}.self_attn."
    _, _, heads, groups, d = _dims(cfg)
    sd = {dst + QKV + kind: separate_to_qkv(t[a + f"q_proj.{kind}"], t[a + f"k_proj.{kind}"], t[a + f"v_proj.{kind}"],
                                            heads, groups, d) for kind in ("weight", "bias")}
    sd.update({dst + PROJ + "weight": t[a + "o_proj.weight"], dst + PROJ + "bias": t[a + "o_proj.bias"],
               dst + SINK: t[a + "sinks"], dst + "input_norm.weight": t[src + "input_layernorm.weight"],
               dst + "pre_mlp_norm.weight": t[src + "post_attention_layernorm.weight"],
               dst + ROUTER: t[src + "mlp.router.weight"], dst + ROUTER_BIAS: t[src + "mlp.router.bias"]})
    sd.update(_experts_state(t, src + "mlp.experts.", dst, cfg["num_experts"], grouped))
    return sd


def from_gptoss(hf: dict, hf_sd, grouped: bool = False) -> tuple[dict, dict]:
    """(flat config, single-process unpadded state dict) of a gpt-oss config and tensors; the experts
    one MLP each, or stacked for ``--moe-grouped-gemm`` when ``grouped``."""
    hf = with_hf_defaults(hf, "gpt_oss")
    cfg = _gptoss_config(hf)
    cfg["moe_grouped_gemm"] = grouped
    t = strip_prefix(hf_sd, "model.")
    try:
        sd = {E + "word_embeddings.weight": t["embed_tokens.weight"], FINAL + "weight": t["norm.weight"]}
        for i in range(cfg["num_layers"]):
            sd.update(_layer_state(t, cfg, i, grouped))
    except KeyError as err:
        raise ConfigError(f"the gpt_oss weights have no tensor model.{err.args[0]}; the folder does not match its "
                          "config.json (only unquantized stacked experts, gate_up_proj / down_proj, are read)") from None
    if cfg["untie_embeddings_and_output_weights"]:
        _require("lm_head.weight" in hf_sd, "tie_word_embeddings is false but the weights have no lm_head.weight")
        sd["output_layer.weight"] = hf_sd["lm_head.weight"]
    return cfg, {k: v.contiguous() for k, v in sd.items()}
