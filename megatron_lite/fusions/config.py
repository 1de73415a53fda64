"""The ``fusion`` section of the run's Config: Megatron's kernel-fusion flags, the jit_fuser mode
and regional ``torch.compile``.

Megatron's CLI turns its fusions on by default and has only ``--no-...`` switches (here each also
has the positive form); ``TransformerConfig``'s own defaults leave them off, so a model built
without the CLI computes exactly what it did before these flags existed. :func:`fusion_fields`
maps the flags to TransformerConfig's fields, with Megatron's rules: bias + GeLU fusion needs
biases (``--disable-bias-linear`` turns it off, as in Megatron), and with ``--swiglu`` the
bias + SwiGLU flag decides instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .jit import JIT_FUSER_MODES

CROSS_ENTROPY_FUSION_IMPLS = ("native", "te")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass
class FusionConfig:
    bias_gelu_fusion: bool = True
    """Fuse the MLP's bias add and GeLU; the fused GeLU is the tanh approximation (Megatron's)."""
    bias_swiglu_fusion: bool = True
    """Fuse the MLP's bias add and SwiGLU (--swiglu)."""
    bias_dropout_fusion: bool = True
    """Fuse bias add, dropout and residual add after attention and MLP."""
    masked_softmax_fusion: bool = True
    """Scale, mask and softmax of attention in one fused kernel (SDPA); off: the explicit math."""
    attention_backend: str = "auto"
    """Accepted for Megatron scripts: it changes nothing, the attention kernel is always picked per call (flash-attn when installed and the inputs allow it, else PyTorch SDPA; auto is the only value taken)."""
    rope_fusion: bool = True
    """Apply rotary embeddings with one fused function (--position-embedding-type rope)."""
    no_persist_layer_norm: bool = False
    """Accepted for Megatron scripts: LayerNorm is always PyTorch's single fused kernel here."""
    gradient_accumulation_fusion: bool = True
    """Weight-gradient GEMMs accumulate straight into the fp32 main_grad buffer."""
    cross_entropy_loss_fusion: bool = False
    """Compute the vocab-parallel cross-entropy's per-token pieces with jit_fuser functions."""
    cross_entropy_fusion_impl: str = "native"
    """Fused cross-entropy implementation: native (te needs Transformer Engine and is refused)."""
    jit_fuser: str = "auto"
    """How fused functions run: auto (torch.compile on GPUs, eager on CPUs), compile, or eager. Where they cannot compile (no working C++ compiler for Inductor on a CPU) they run eagerly after one line."""
    torch_compile: bool = False
    """Regional torch.compile: each transformer layer's forward (compiled once, reused) and the loss (eager with --jit-fuser eager; a start-up line says what is compiled)."""
    torch_compile_backend: str = "inductor"
    """torch.compile backend for --torch-compile and jit_fuser: inductor, aot_eager or eager."""
    retain_host_memory: bool = True
    """CPU runs: freed host memory stays in the process for reuse (glibc), so large tensors stop page-faulting."""


FUSION_CHOICES = {"jit_fuser": list(JIT_FUSER_MODES), "cross_entropy_fusion_impl": list(CROSS_ENTROPY_FUSION_IMPLS),
                  "torch_compile_backend": list(COMPILE_BACKENDS),
                  "attention_backend": ["auto"]}  # inert: what always happens (Megatron's others refused by value)


def check_fusion_flags(fusion: FusionConfig, disable_bias_linear: bool) -> None:
    """Megatron's adjustments and refusals; raises ConfigError naming the flag."""
    if disable_bias_linear:
        fusion.bias_gelu_fusion = False  # Megatron: no bias, nothing to fuse with GeLU
    if fusion.cross_entropy_fusion_impl == "te":
        raise ConfigError("--cross-entropy-fusion-impl te needs Transformer Engine's parallel cross-entropy, which "
                          "is not wired in; use --cross-entropy-fusion-impl native")


def fusion_fields(fusion: FusionConfig | dict | None, swiglu: bool) -> dict:
    """TransformerConfig's fusion fields from the flags (a FusionConfig, or a saved flat config: keys
    a checkpoint lacks keep TransformerConfig's defaults)."""
    if fusion is None:
        return {}
    get = fusion.get if isinstance(fusion, dict) else (lambda k, d=None: getattr(fusion, k, d))
    out = {}
    activation = get("bias_swiglu_fusion") if swiglu else get("bias_gelu_fusion")
    for field, value in (("bias_activation_fusion", activation), ("bias_dropout_fusion", get("bias_dropout_fusion")),
                         ("masked_softmax_fusion", get("masked_softmax_fusion")), ("apply_rope_fusion", get("rope_fusion")),
                         ("gradient_accumulation_fusion", get("gradient_accumulation_fusion"))):
        if value is not None:
            out[field] = bool(value)
    loss = get("cross_entropy_loss_fusion")
    if loss is not None:
        out["cross_entropy_loss_fusion"] = bool(loss) or bool(get("torch_compile"))  # --torch-compile compiles the loss
    return out


def tanh_gelu(cfg: dict) -> bool:
    """Whether the MLP of a saved flat config computes the tanh GeLU: ``--openai-gelu``, or the fused
    bias + GeLU (Megatron's default; a checkpoint written before the flag existed lacks it: exact)."""
    if cfg.get("swiglu") or cfg.get("squared_relu") or cfg.get("quick_geglu"):  # no GeLU at all
        return False
    return bool(cfg.get("openai_gelu")) or (bool(cfg.get("bias_gelu_fusion")) and not cfg.get("disable_bias_linear"))
