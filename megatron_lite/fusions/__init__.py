"""Kernel fusion and compilation: Megatron's fused functions in plain PyTorch (``jit_fuser``), the
fusion flags, and regional ``torch.compile`` (``--torch-compile``)."""

from .activations import bias_gelu_impl, bias_swiglu_impl
from .config import FusionConfig, fusion_fields
from .jit import jit_fuser, set_jit_fuser
from .residual import bias_dropout_add

__all__ = ["FusionConfig", "bias_dropout_add", "bias_gelu_impl", "bias_swiglu_impl", "fusion_fields", "jit_fuser",
           "set_jit_fuser"]
