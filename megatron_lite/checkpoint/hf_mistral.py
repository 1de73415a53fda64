"""Hugging Face ``mistral`` (``MistralForCausalLM``) <-> megatron_lite's single-process GPT weights, and the
sliding window of the Hugging Face configs that have one (mistral, qwen2).

Mistral is the llama layout (:mod:`~megatron_lite.checkpoint.hf`: RoPE, RMSNorm, SwiGLU, grouped-query
attention, no biases) with sliding-window attention in every layer. Hugging Face's
``sliding_window: W`` lets a query see itself and the ``W - 1`` keys before it, which is our
``--window-size W-1 0``; ``sliding_window: null`` is full attention. Qwen2 marks which layers use
the window (``layer_types``, or ``use_sliding_window`` with every layer from ``max_window_layers``
on): the pattern becomes ``--window-attn-skip-freq`` as a 0/1 list (1 = window) when it is mixed.
Export writes a window model as ``mistral`` (every layer windowed, biases off), ``qwen2`` (any
pattern) or ``mixtral`` (MoE, every layer windowed); the other formats cannot express it and refuse
``--window-size``.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..models.window_config import parse_skip_freq
from .hf import from_hf, to_hf
from .hf_defaults import with_hf_defaults


def _require(cond, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def has_window(cfg: dict) -> bool:
    """Whether the flat config ``cfg`` has sliding-window attention in some layer."""
    window = cfg.get("window_size")
    return window is not None and tuple(window) != (-1, -1)


def window_from_hf(sliding_window, windowed: list[bool]) -> dict:
    """Our window fields of a Hugging Face ``sliding_window`` used by the layers marked in ``windowed``."""
    if sliding_window is None or not any(windowed):
        return {"window_size": None, "window_attn_skip_freq": None}
    _require(int(sliding_window) >= 1, f"sliding_window {sliding_window} must be at least 1 (the token itself)")
    freq = None if all(windowed) else "[" + ",".join(str(int(w)) for w in windowed) + "]"
    return {"window_size": [int(sliding_window) - 1, 0], "window_attn_skip_freq": freq}


def hf_window(cfg: dict, style: str) -> tuple[int | None, list[bool]]:
    """(Hugging Face ``sliding_window``, which layers use it) of the flat config ``cfg``."""
    layers = cfg["num_layers"]
    if not has_window(cfg):
        return None, [False] * layers
    left, right = cfg["window_size"]
    _require(left >= 0 and right == 0, f"--window-size {left} {right} cannot be expressed in the {style} format "
             "(a causal window of the last N tokens: LEFT >= 0, RIGHT 0)")
    return left + 1, parse_skip_freq(cfg.get("window_attn_skip_freq"), layers)


def check_window_exportable(cfg: dict, style: str) -> None:
    """Refuse a window model in a format other than mistral and qwen2 (it would attend to everything)."""
    _require(not has_window(cfg) or style in ("mistral", "qwen2", "mixtral", "gpt_oss"),
             f"--window-size {' '.join(map(str, cfg.get('window_size') or ()))} (sliding-window attention) cannot be "
             f"expressed in the {style} format; "
             + ("use --hf-style mixtral or gpt_oss" if cfg.get("num_experts") else window_home(cfg)))


def window_home(cfg: dict) -> str:
    """Where a refused window model can go instead: the one dense format that holds its window and
    biases (qwen2: q/k/v biases, any layers; mistral: no biases, every layer), else Megatron layouts."""
    qkv_only = bool(cfg.get("add_qkv_bias") and cfg.get("disable_bias_linear"))
    every = all(parse_skip_freq(cfg.get("window_attn_skip_freq"), cfg["num_layers"]))
    if qkv_only:
        return "use --hf-style qwen2"
    if cfg.get("disable_bias_linear") and every:
        return "use --hf-style mistral"
    return ("no Hugging Face format the converter writes holds this window with these biases (qwen2: "
            "--add-qkv-bias --disable-bias-linear; mistral: no biases, every layer windowed); convert between "
            "Megatron layouts instead")


def to_mistral(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a single-process, unpadded state dict ``sd``."""
    _require(cfg.get("disable_bias_linear") and not cfg.get("add_qkv_bias"), "the mistral format has no biases: "
             "it needs --disable-bias-linear without --add-qkv-bias; "
             + (window_home(cfg) if has_window(cfg) else "use --hf-style llama or qwen2"))
    window, windowed = hf_window(cfg, "mistral")
    _require(all(windowed) or not any(windowed), f"--window-attn-skip-freq {cfg.get('window_attn_skip_freq')} "
             f"cannot be expressed in the mistral format (every layer has the window); {window_home(cfg)}")
    hf, out = to_hf({**cfg, "window_size": None}, sd, "llama", "mistral")
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
        hf.pop(key)
    hf.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    return hf, out


def from_mistral(hf: dict, hf_sd) -> tuple[dict, dict]:
    """(flat config, single-process unpadded state dict) of a Mistral config and its tensors."""
    hf = with_hf_defaults(hf, "mistral")
    cfg, sd = from_hf({**hf, "model_type": "llama", "attention_bias": False, "mlp_bias": False}, hf_sd)
    cfg.update(window_from_hf(hf.get("sliding_window"), [True] * cfg["num_layers"]))
    return cfg, sd


def qwen2_windowed_layers(hf: dict) -> list[bool]:
    """Which layers of a Qwen2 config use its sliding window (``layer_types`` when written)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        _require(len(types) == layers and set(types) <= {"sliding_attention", "full_attention"},
                 f"layer_types {types} must name full_attention or sliding_attention for each of the {layers} layers")
        return [t == "sliding_attention" for t in types]
    first = hf.get("max_window_layers") or 0
    return [bool(hf.get("use_sliding_window")) and i >= first for i in range(layers)]
