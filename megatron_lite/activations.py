"""MLP activation and query/key-norm flags beyond GeLU / SwiGLU, with Megatron-LM's names and semantics.

* ``--squared-relu`` (Nemotron): ``relu(x)^2``, not gated (fc1 is ``ffn`` rows wide).
* ``--quick-geglu`` (gpt-oss): gated like SwiGLU (fc1 is ``[gate; linear]``, ``2 x ffn`` rows, split
  over TP with stride 2), ``quick_gelu(gate) * (linear + --glu-linear-offset)`` where
  ``quick_gelu(x) = x sigmoid(1.702 x)``.
* ``--glu-linear-offset`` (default 0; gpt-oss: 1) and ``--activation-func-clamp-value`` (default none;
  gpt-oss: 7) apply to either gated unit (``--swiglu`` or ``--quick-geglu``), as Megatron's gated MLP
  does: the gate half is clamped from above at the value, the linear half to ``[-value, value]``.
* ``--use-fused-weighted-squared-relu``: Megatron's fused ``relu(x)^2 * routing weight`` of MoE experts.
  The experts here already compute the activation and its routing weight in one function, with the
  same numbers, so the flag is accepted with ``--squared-relu`` and changes nothing.
* ``--qk-l2-norm`` (Llama 4): queries and keys are scaled per head to unit mean square,
  ``x / sqrt(mean(x^2) + eps)`` with eps ``--norm-epsilon``, no weights. It sits where
  ``--qk-layernorm``'s norms sit (after the QKV projection, before the rotary embedding), as in
  Megatron-LM; the rotary embedding is a rotation of channel pairs, which leaves the norm unchanged,
  so this equals Llama 4's order (norm after the rotary embedding) up to rounding.

:class:`ActivationConfig` is mixed into the ``model`` section of the run's Config (saved with
checkpoints) and into :class:`~megatron_lite.models.transformer_config.TransformerConfig`;
:func:`check_activation_fields` validates it there with one line naming the flag and the fix.
:class:`MLPActivation` is the activation of the dense MLP (models/mlp.py), the MoE experts and the
shared experts (moe/), so it lives outside both packages (moe/ must not import models/).

A gated unit splits its input into halves ``[gate; linear]`` along the last dimension (Megatron's
layout: concatenated halves, not gpt-oss's interleaved columns). Every TP rank holds its slice of
both halves (fc1 split with stride 2), so the activation is local to the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import ConfigError


@dataclass
class ActivationConfig:
    squared_relu: bool = False
    """Squared-ReLU MLP, relu(x)^2 (Nemotron), instead of GeLU; not gated."""
    quick_geglu: bool = False
    """Gated quick-GeLU MLP (gpt-oss): x_gate sigmoid(1.702 x_gate) (x_linear + --glu-linear-offset), fc1 holding [gate; linear] like --swiglu."""
    glu_linear_offset: float = 0.0
    """With --swiglu or --quick-geglu: added to the linear half of the gated unit before the product (gpt-oss: 1.0)."""
    activation_func_clamp_value: float | None = None
    """With --swiglu or --quick-geglu: clamp the gate half to at most this and the linear half to [-this, this] before the activation (gpt-oss: 7.0). Default: no clamp."""
    use_fused_weighted_squared_relu: bool = False
    """With --squared-relu: MoE experts compute relu(x)^2 times the routing weight in one function (they always do here; accepted for Megatron-LM scripts)."""
    qk_l2_norm: bool = False
    """Scale queries and keys per head to unit mean square, x / sqrt(mean(x^2) + --norm-epsilon) (Llama 4), no weights."""


def is_gated(config) -> bool:
    """Whether fc1 holds two halves ``[gate; linear]`` (``2 x ffn`` rows, split over TP with stride 2)."""
    return bool(config.swiglu or getattr(config, "quick_geglu", False))


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_activation_fields(config) -> None:
    """Validate the activation and query/key-norm flags of a TransformerConfig."""
    chosen = [f"--{n.replace('_', '-')}" for n in ("swiglu", "squared_relu", "quick_geglu") if getattr(config, n)]
    _require(len(chosen) <= 1, f"{' and '.join(chosen)} are different MLP activations; keep one")
    _require(not (config.openai_gelu and (config.squared_relu or config.quick_geglu)),
             f"--openai-gelu picks the GeLU's form, and {chosen[0] if chosen else ''} replaces the GeLU; drop --openai-gelu")
    gated = is_gated(config)
    _require(config.glu_linear_offset == 0.0 or gated,
             f"--glu-linear-offset {config.glu_linear_offset} needs a gated MLP; add --quick-geglu or --swiglu, or drop it")
    clamp = config.activation_func_clamp_value
    if clamp is not None:
        _require(gated, f"--activation-func-clamp-value {clamp} needs a gated MLP; add --quick-geglu or --swiglu, "
                 "or drop it")
        _require(clamp > 0, f"--activation-func-clamp-value {clamp} must be positive (gpt-oss: 7.0)")
    _require(not config.use_fused_weighted_squared_relu or config.squared_relu,
             "--use-fused-weighted-squared-relu fuses the squared ReLU of MoE experts; add --squared-relu or drop it")
    if config.qk_l2_norm:
        _require(not config.multi_latent_attention,
                 "--qk-l2-norm is not supported with --multi-latent-attention (as in Megatron-LM); drop one")
        _require(not config.qk_layernorm,
                 "--qk-l2-norm replaces --qk-layernorm's query/key norms (Megatron-LM ignores --qk-layernorm with "
                 "it); drop --qk-layernorm")


# -- the functions -----------------------------------------------------------------------------------
QUICK_GELU_ALPHA = 1.702


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2``."""
    return torch.square(F.relu(x))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x sigmoid(1.702 x)``."""
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


def gated(x: torch.Tensor, act, linear_offset: float = 0.0, clamp: float | None = None) -> torch.Tensor:
    """``act(gate) * (linear + linear_offset)`` of ``x = [gate; linear]``; with ``clamp`` the gate is
    clamped to at most ``clamp`` and the linear half to ``[-clamp, clamp]`` first (gpt-oss)."""
    gate, linear = x.chunk(2, dim=-1)
    if clamp is not None:
        gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
    if linear_offset:
        linear = linear + linear_offset
    return act(gate) * linear


class MLPActivation:
    """The configured activation as a callable: ``MLPActivation(config, gelu_approximate)(x)``.
    ``gelu_approximate`` ("none" or "tanh") is the GeLU's form when the MLP is a plain GeLU one."""

    def __init__(self, config, gelu_approximate: str = "none"):
        self.offset = float(getattr(config, "glu_linear_offset", 0.0) or 0.0)
        self.clamp = getattr(config, "activation_func_clamp_value", None)
        self.gelu_approximate = gelu_approximate
        if config.swiglu:
            self.kind, self.gate, self.act = "swiglu", True, F.silu
        elif getattr(config, "quick_geglu", False):
            self.kind, self.gate, self.act = "quick_geglu", True, quick_gelu
        elif getattr(config, "squared_relu", False):
            self.kind, self.gate, self.act = "squared_relu", False, squared_relu
        else:
            self.kind, self.gate, self.act = "gelu", False, self._gelu

    def _gelu(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.gelu_approximate)

    @property
    def plain(self) -> bool:
        """Plain GeLU or SwiGLU (no offset, no clamp): what the fused bias + activation kernels compute."""
        return self.kind in ("swiglu", "gelu") and not self.offset and self.clamp is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gated(x, self.act, self.offset, self.clamp) if self.gate else self.act(x)


class L2Norm(torch.nn.Module):
    """``--qk-l2-norm``: ``x / sqrt(mean(x^2) + eps)`` over the last dimension (one head), computed in fp32
    and returned in ``x``'s dtype; no weights."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)


UNEXPORTABLE = ("squared_relu", "quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "qk_l2_norm",
                "rotary_interleaved", "softmax_scale", "attention_output_gate", "no_rope_freq",  # models/attention_config.py
                "apply_residual_connection_post_layernorm")  # no family takes the residual from the norm's output


GPT_OSS_EXPORTABLE = ("quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "softmax_type")
"""The flags of UNEXPORTABLE (and --softmax-type) that the gpt_oss format holds (its exporter checks their values)."""
YARN_EXPORTABLE = ("gpt_oss", "deepseek_v3")
"""The formats whose exporters write --rope-type yarn's rope_parameters (the others would drop the scaling)."""


def check_hf_exportable(cfg: dict, style: str = "") -> None:
    """Refuse (one line) a Hugging Face export of a model using one of these flags: none of the families
    the converter writes (gpt2, llama, mistral, qwen2/3, mixtral, qwen3_moe, deepseek_v3, bert) computes it;
    gpt_oss computes the gpt-oss ones (GPT_OSS_EXPORTABLE). ``--rope-type yarn`` is refused likewise
    but for gpt_oss and deepseek_v3 (YARN_EXPORTABLE)."""
    allowed = GPT_OSS_EXPORTABLE if style == "gpt_oss" else ()
    names = [k for k in UNEXPORTABLE if k not in allowed and cfg.get(k) not in (None, False, 0, 0.0)]
    if "softmax_type" not in allowed and cfg.get("softmax_type", "vanilla") != "vanilla":  # parallel/attention_sink.py
        names.append("softmax_type")
    if style not in YARN_EXPORTABLE and cfg.get("rope_type") == "yarn":  # the llama-style writers know llama3/linear only
        names.append("rope_type")
    used = [f"--{k.replace('_', '-')} {cfg[k]}" if k in ("softmax_type", "rope_type") else f"--{k.replace('_', '-')}"
            for k in names]
    hint = ("only the gpt_oss format (mixture of experts with biases) holds it: use --hf-style gpt_oss"
            if names and set(names) <= {*GPT_OSS_EXPORTABLE, "rope_type"} and names != ["rope_type"]
            else "of the formats written here only gpt_oss and deepseek_v3 hold YaRN; convert to --saver megatron "
            "instead" if names == ["rope_type"] else "convert to --saver megatron instead")
    _require(not used, f"the checkpoint was trained with {', '.join(used)}, which the {style or 'chosen'} Hugging Face "
             f"format does not compute; export is refused ({hint})")
