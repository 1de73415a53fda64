"""The startup log's FP8 line: the recipe, and which GEMM kernel runs it on this device and why
(``torch._scaled_mm``, or the CPU's exact dequantised GEMMs with the dtype a one-time probe chose)."""

from __future__ import annotations

import torch

from .fp8 import Fp8Recipe
from .fp8_block import BLOCK_RECIPES
from .fp8_ops import (
    BF16_MARGIN,
    E4M3,
    E5M2,
    SCALED_MM,
    cpu_gemm_dtype,
    cpu_gemm_probe,
    cpu_native_widening,
    fp8_gemm_path,
    scaled_mm_blocker,
)


def describe_fp8_path(recipe: Fp8Recipe, device: torch.device) -> str:
    """One line for the startup log: the recipe and which GEMM kernel runs it on ``device`` (and why)."""
    if fp8_gemm_path(device) == SCALED_MM and recipe.recipe in BLOCK_RECIPES:
        return f"FP8 {recipe.describe()}; GEMMs as dequantised matmuls on {device.type} (no block-scaled kernel used)"
    if fp8_gemm_path(device) == SCALED_MM:
        probe = torch.zeros(16, 16, dtype=E4M3, device=device)
        reason = scaled_mm_blocker(probe, probe.t())
        kernel = "torch._scaled_mm" if reason is None else f"dequantised matmuls ({reason})"
        return f"FP8 {recipe.describe()}; GEMMs via {kernel} on {device.type}"
    gflops = cpu_gemm_probe()
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}[cpu_gemm_dtype()]
    return (f"FP8 {recipe.describe()}; GEMMs on cpu (decided by device: torch._scaled_mm is emulated there) "
            f"as exact {dtype} dequantised GEMMs with fp32 accumulation ({dtype} chosen by a one-time probe: "
            f"fp32 {gflops[torch.float32]:.1f} GFLOP/s, bf16 {gflops[torch.bfloat16]:.1f} GFLOP/s"
            f"{'' if dtype == 'bf16' else '; bf16 is used only when ' + str(BF16_MARGIN) + 'x faster'}); "
            f"FP8 widened to it by {_widening(torch.bfloat16 if dtype == 'bf16' else torch.float32)}")


def _widening(dtype: torch.dtype) -> str:
    """How this CPU widens each FP8 format to ``dtype`` (one-time probes)."""
    how = {fmt: "PyTorch's conversion" if cpu_native_widening(fmt, dtype) else "fp16 bit placement"
           for fmt in (E4M3, E5M2)}
    if how[E4M3] == how[E5M2]:
        return f"{how[E4M3]} (one-time probe)"
    return f"{how[E4M3]} (E4M3), {how[E5M2]} (E5M2) (one-time probes)"
