"""Low-level FP8 pieces: formats, the saturating cast, scaling arithmetic and the scaled GEMM.

Scale convention (the one delayed-scaling recipes use): a high-precision tensor ``x`` is stored as
``q = fp8(clamp(x * scale, -fp8_max, fp8_max))`` and read back as ``q * scale_inv`` with
``scale_inv = 1 / scale``. ``torch._scaled_mm`` takes the *dequantisation* multipliers, i.e.
``scale_inv`` of each operand.

Portability rules kept here so the same code runs on CPU and on CUDA:

* Clamp before every cast: older torch turns an E4M3 overflow into NaN and E5M2 overflows to inf.
* ``torch._scaled_mm`` wants 2-D operands, the first row-major and the second column-major, both
  inner and output dimensions divisible by 16, fp32 scales, and never E5M2 x E5M2. The CPU kernel is
  more lenient, but nothing here relies on that: a GEMM that breaks a rule (or a device without FP8
  GEMMs) runs as a dequantised matmul instead, with the same quantised operands, and the reason is
  returned so the caller can report it.
* The ``scale_result`` argument is avoided: it divides on CPU but multiplies on CUDA.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FLOAT32_MAX = torch.finfo(torch.float32).max
GEMM_ALIGNMENT = 16


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor (0 for an empty tensor); NaN and inf propagate."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast ``fp8(clamp(x * scale, -max, max))``; the product is formed in fp32."""
    limit = FP8_MAX[dtype]
    return (x.detach().float() * scale).clamp_(-limit, limit).to(dtype)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 value of an FP8 tensor: ``q * scale_inv``."""
    return q.float() * scale_inv


def delayed_scale(amax_value: torch.Tensor, old_scale: torch.Tensor, fp8_max: torch.Tensor,
                  margin: int) -> torch.Tensor:
    """Delayed-scaling update, element-wise: ``(fp8_max / amax) / 2^margin``.

    An amax that is zero, inf or NaN carries no information (the tensor was never seen, or
    overflowed), so the old scale is kept; a scale that overflows fp32 becomes the largest float.
    """
    scale = (fp8_max / amax_value) / (2.0**margin)
    usable = torch.isfinite(amax_value) & (amax_value > 0)
    scale = torch.where(usable, scale, old_scale)
    return torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)


def current_scale(amax_value: torch.Tensor, fp8_max: torch.Tensor) -> torch.Tensor:
    """Tensorwise (current) scaling: ``fp8_max / amax`` of this very tensor.

    A zero or non-finite amax gives scale 1; a scale that overflows fp32 becomes the largest float.
    """
    scale = fp8_max / amax_value
    usable = torch.isfinite(amax_value) & (amax_value > 0)
    scale = torch.where(usable, scale, torch.ones_like(scale))
    return torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)


def roll_amax_history(history: torch.Tensor) -> torch.Tensor:
    """The history after a scale update: ``[0, old[2], ..., old[L-1], old[0]]``.

    Row 0 is the slot the next step records into; the just-used amax ``old[0]`` moves to the end
    and the oldest entry ``old[1]`` drops out, so the ``max`` algorithm always sees the last L
    recorded amaxes. With L == 1 the history is simply cleared.
    """
    rolled = torch.cat([history[1:], history[:1]])
    rolled[0] = 0.0
    return rolled


def amax_from_history(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax a scale is computed from: the latest row (``most_recent``) or the column max (``max``)."""
    if algo == "most_recent":
        return history[0].clone()
    if algo == "max":
        return history.amax(dim=0)
    raise ValueError(f"unknown amax compute algorithm {algo!r}")


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (a transposed view of a contiguous transpose)."""
    return t.t().contiguous().t()


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t [M, K]`` with zero rows appended up to a multiple of ``multiple`` rows (``t`` itself if none
    are needed). A GEMM that sums over rows (a weight gradient ``dY^T X``) is unchanged by them."""
    pad = -t.shape[0] % multiple
    if pad == 0:
        return t
    return torch.cat([t, torch.zeros(pad, *t.shape[1:], dtype=t.dtype, device=t.device)])


def scaled_mm_blocker(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why ``torch._scaled_mm(a, b, ...)`` cannot take these operands, or None if it can."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if a.is_cuda and torch.cuda.get_device_capability(a.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(a.device)
        return f"GPU compute capability {major}.{minor} has no FP8 GEMMs (needs 8.9 or newer)"
    if a.dim() != 2 or b.dim() != 2:
        return f"operands must be 2-D, got {a.dim()}-D and {b.dim()}-D"
    k, n = a.shape[1], b.shape[1]
    for name, size in (("inner dimension", k), ("output dimension", n)):
        if size % GEMM_ALIGNMENT:
            return f"{name} {size} is not divisible by {GEMM_ALIGNMENT}"
    if not a.is_contiguous():
        return "first operand is not row-major"
    if not b.t().is_contiguous():
        return "second operand is not column-major"
    if a.dtype == E5M2 and b.dtype == E5M2:
        return "E5M2 x E5M2 has no FP8 GEMM"
    return None


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, str | None]:
    """``(a * a_scale_inv) @ (b * b_scale_inv)`` for FP8 ``a [M, K]`` and ``b [K, N]``.

    Runs ``torch._scaled_mm`` when the operands are eligible; otherwise dequantises both and runs
    an fp32 matmul (the same numbers up to accumulation order). Returns ``(out, reason)`` where
    ``reason`` is None for the FP8 kernel and says why it was not used otherwise.
    """
    if a.numel() == 0 or b.numel() == 0:  # an MoE expert without tokens: the exact (empty or zero) product,
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device), None  # no kernel asked
    reason = scaled_mm_blocker(a, b)
    if reason is None:
        out = torch._scaled_mm(a, b, scale_a=a_scale_inv.float().reshape(()),
                               scale_b=b_scale_inv.float().reshape(()), out_dtype=out_dtype)
        return out, None
    out = dequantize(a, a_scale_inv) @ dequantize(b, b_scale_inv)
    return out.to(out_dtype), reason
