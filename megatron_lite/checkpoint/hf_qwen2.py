"""Hugging Face ``qwen2`` (``Qwen2ForCausalLM``) <-> megatron_lite's single-process GPT weights.

Qwen2 is the llama layout (:mod:`~megatron_lite.checkpoint.hf`: RoPE, RMSNorm, SwiGLU, grouped-query
attention) with a bias on the q/k/v projections and on no other linear layer: ours with
``--disable-bias-linear --add-qkv-bias``. The fused QKV bias ``[groups, (heads_per_group + 2) * head_dim]``
is split into q/k/v_proj.bias per group like the weight. Sliding-window attention (``use_sliding_window``,
``sliding_window``, ``max_window_layers``, ``layer_types``) is ``--window-size`` and, for a mix of
windowed and full layers, ``--window-attn-skip-freq`` (:mod:`~megatron_lite.checkpoint.hf_mistral`).
"""

from __future__ import annotations

from ..errors import ConfigError
from .hf import (
    LAYER,
    QKV,
    _dims,
    check_exportable,
    from_hf,
    pick_style,
    qkv_to_separate,
    separate_to_qkv,
    to_hf,
)
from .hf_defaults import with_hf_defaults
from .hf_mistral import has_window, hf_window, qwen2_windowed_layers, window_from_hf, window_home


def _require(cond, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def to_qwen2(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a single-process, unpadded state dict ``sd``."""
    _require(not cfg.get("qk_layernorm"), "--qk-layernorm (per-head query/key norms) cannot be expressed in the qwen2 "
             f"format; use --hf-style {pick_style(cfg)}")
    _require(cfg.get("add_qkv_bias") and cfg.get("disable_bias_linear"), "the qwen2 format has biases on q/k/v "
             "only: it needs --add-qkv-bias with --disable-bias-linear; "
             + (window_home(cfg) if has_window(cfg) else "use --hf-style llama"))
    check_exportable(cfg, "qwen2")  # the llama layout's refusals, naming this format
    window, windowed = hf_window(cfg, "qwen2")
    hf, out = to_hf({**cfg, "add_qkv_bias": False, "window_size": None}, sd, "llama", "qwen2")  # the llama export, no biases
    layers, _, heads, groups, d = _dims(cfg)
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
        hf.pop(key)
    first = next((i for i, w in enumerate(windowed) if w), layers)  # exact when the windowed layers come last
    hf.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=any(windowed),
              sliding_window=window, max_window_layers=first,
              layer_types=["sliding_attention" if w else "full_attention" for w in windowed])
    for i in range(layers):
        q, k, v = qkv_to_separate(sd[LAYER.format(i=i) + QKV + "bias"], heads, groups, d)
        dst = f"model.layers.{i}.self_attn."
        out.update({dst + "q_proj.bias": q, dst + "k_proj.bias": k, dst + "v_proj.bias": v})
    return hf, out


def from_qwen2(hf: dict, hf_sd) -> tuple[dict, dict]:
    """(flat config, single-process unpadded state dict) of a Qwen2 config and its tensors."""
    hf = with_hf_defaults(hf, "qwen2")
    cfg, sd = from_hf({**hf, "model_type": "llama", "attention_bias": False, "mlp_bias": False}, hf_sd, "qwen2")
    cfg["add_qkv_bias"] = True
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None  # transformers ignores it otherwise
    cfg.update(window_from_hf(window, qwen2_windowed_layers(hf)))
    layers, _, heads, groups, d = _dims(cfg)
    for i in range(layers):
        a = f"model.layers.{i}.self_attn."
        try:
            q, k, v = (hf_sd[a + f"{x}_proj.bias"] for x in "qkv")
        except KeyError as err:
            raise ConfigError(f"the qwen2 weights have no tensor {err.args[0]}; the folder does not match its "
                              "config.json") from None
        sd[LAYER.format(i=i) + QKV + "bias"] = separate_to_qkv(q, k, v, heads, groups, d).contiguous()
    return cfg, sd
