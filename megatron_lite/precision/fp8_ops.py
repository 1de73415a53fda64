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

Which kernel (:func:`fp8_gemm_path`, decided by device): GPUs run ``torch._scaled_mm``. On a CPU
``torch._scaled_mm`` is an emulation (it widens to fp32 itself) that runs hundreds to thousands of
times slower than a plain GEMM, so CPUs run :func:`dequantised_matmul` instead: the FP8 operands are
widened exactly (every E4M3 and E5M2 value is a bf16 and an fp32 value), multiplied with fp32
accumulation (a product of two FP8 values is exact in fp32) and the scales applied to the result:
``_scaled_mm``'s result up to summation order. The widened dtype is whichever GEMM is faster on this
CPU, measured once per process (:func:`cpu_gemm_dtype`): bf16 where the CPU has bf16 matrix units,
fp32 elsewhere. A bf16 GEMM rounds its fp32 accumulator to bf16, so it is used only for bf16 results,
with the scales as its ``alpha`` (applied to the fp32 accumulator: rounded once, as ``_scaled_mm``
rounds); fp32 results always come from the fp32 GEMM.
"""

from __future__ import annotations

import functools
import time

import torch

from ..fusions.jit import jit_fuser
from ..perf.matmul_peak import measure_matmul_peak

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FLOAT32_MAX = torch.finfo(torch.float32).max
GEMM_ALIGNMENT = 16


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor (0 for an empty tensor); NaN and inf propagate.

    One pass either way: on a CPU from ``torch.aminmax`` (the inf-norm reduction there is ~10x
    slower: 10 ms against 1 for 6.3 M entries on 2 cores), elsewhere the inf-norm (one kernel)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if x.device.type == "cpu":
        lo, hi = torch.aminmax(x.detach())
        return torch.maximum(hi.float(), lo.float().neg())
    return torch.linalg.vector_norm(x.detach(), float("inf")).float()  # no |x| temporary


@jit_fuser
def _scale_and_cast(x: torch.Tensor, scale: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
             x_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Saturating cast ``fp8(clamp(x * scale, -max, max))``; the product is formed in fp32.

    On a GPU whose ``jit_fuser`` compiles (the default) this is one fused kernel: it reads ``x`` once
    and writes one byte per element, where the eager operators (widen, scale, clamp, cast) write and
    read an fp32 copy three times. CPUs stay eager even under ``--jit-fuser compile`` (Inductor's CPU
    code narrows to FP8 element by element: 11 ms against 6.5 eager for 6.3 M entries on 2 cores).
    Eagerly, a 16-bit ``x`` is widened and scaled in place, and ``x_amax`` (``amax(x)``, already
    computed for the scale) lets a CPU skip the clamp's pass when ``x_amax * scale`` fits: every
    ``|x_i| * scale`` is then at most that (fp32 rounding is monotonic), so the clamp would change
    nothing."""
    limit = FP8_MAX[dtype]
    x = x.detach()
    if x.device.type != "cpu" and _scale_and_cast.compiles_for(x):
        return _scale_and_cast(x, scale, limit, dtype)
    scaled = x * scale if x.dtype == torch.float32 else x.float().mul_(scale)
    if x_amax is None or x.device.type != "cpu" or not bool(x_amax.float() * scale.float() <= limit):
        scaled.clamp_(-limit, limit)
    return scaled.to(dtype)


_E4M3_IN_FP16 = 256.0  # an E4M3 bit pattern placed in fp16 reads as its value / 256


def _from_fp16(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp16 values in ``dtype``; to bf16 through fp32 (two vectorised passes: faster on a CPU than the
    direct conversion, 3 against 5.4 ms for 6.3 M entries on 2 cores; exact for FP8 values)."""
    if dtype == torch.bfloat16:
        return h.float().to(dtype)
    return h.to(dtype)


def _in_memory_order(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s entries as a 1-D view in memory order when ``t`` is contiguous or a transposed contiguous
    matrix, else None."""
    if t.is_contiguous():
        return t.view(-1)
    return t.t().view(-1) if t.dim() == 2 and t.t().is_contiguous() else None


def _has_e4m3_nan(q: torch.Tensor) -> bool:
    """Whether ``q`` (E4M3) holds a NaN code, 0x7F or 0xFF: the largest int8 and the largest uint8."""
    return int(q.view(torch.int8).max()) == 0x7F or int(q.view(torch.uint8).max()) == 0xFF


WIDEN_CHUNK = 1 << 20  # entries per pass of a large widening on a CPU: its int16/fp16/fp32 stages stay in the cache


def _placed_in_fp16(q_bytes: torch.Tensor, e5m2: bool) -> torch.Tensor:
    """FP8 bytes (as int8) in fp16 bit patterns: an E5M2 byte as the top byte (its infinities and NaN
    included), an E4M3 byte's sign at bit 15 and its other 7 bits at 13..7 (reading value / 256)."""
    bits = q_bytes.to(torch.int16).bitwise_left_shift_(8 if e5m2 else 7)
    return (bits if e5m2 else bits.bitwise_and_(-16512)).view(torch.float16)  # 0xBF80: sign + 7 bits


def _widen_over(q: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """``(w, f)`` with ``w * f`` the exact ``dtype`` values of the FP8 tensor ``q`` (see :func:`widen`):
    ``f`` is 256 when the E4M3 bytes went through the fp16 placement (``w`` is then value / 256), else 1.
    On a CPU whose own conversion is the faster (:func:`cpu_native_widening`), that conversion."""
    if q.device.type != "cpu" or q.numel() == 0 or q.dtype not in (E4M3, E5M2) or cpu_native_widening(q.dtype, dtype):
        return q.to(dtype), 1.0
    return _placed_widening(q, dtype)


def _placed_widening(q: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """:func:`_widen_over` through the fp16 bit placement, for a CPU tensor ``q``. To bf16, a large ``q``
    (contiguous or transposed) is widened ``WIDEN_CHUNK`` entries at a time into a result of its layout,
    each chunk's fp16 and fp32 stages in the cache (1.3-1.6x faster than whole-tensor passes on a 2-core
    CPU; to fp32 there is no intermediate stage to keep)."""
    flat = _in_memory_order(q)  # the NaN check reads it in memory order: over a transposed view it is ~4x slower
    if q.dtype == E4M3 and _has_e4m3_nan(q if flat is None else flat):
        return q.to(dtype), 1.0
    e5m2 = q.dtype == E5M2
    factor = 1.0 if e5m2 else _E4M3_IN_FP16
    if dtype != torch.bfloat16 or flat is None or flat.numel() <= WIDEN_CHUNK:  # to fp32 or fp16: one pass already
        return _from_fp16(_placed_in_fp16(q.view(torch.int8), e5m2), dtype), factor
    out = torch.empty_like(q, dtype=dtype)  # q's layout
    flat_out = _in_memory_order(out)
    for start in range(0, flat.numel(), WIDEN_CHUNK):
        h = _placed_in_fp16(flat[start:start + WIDEN_CHUNK].view(torch.int8), e5m2)
        flat_out[start:start + WIDEN_CHUNK].copy_(h.float())  # fp16 -> fp32 -> bf16, as _from_fp16
    return out, factor


WIDEN_PROBE_ENTRIES = 1 << 20
NATIVE_WIDENING_MARGIN = 1.25  # PyTorch's conversion replaces the placement only when this much faster


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


@functools.cache
def cpu_native_widening(fp8_dtype: torch.dtype, dtype: torch.dtype, rounds: int = 5) -> bool:
    """Whether PyTorch's own conversion of ``fp8_dtype`` to ``dtype`` is ``NATIVE_WIDENING_MARGIN`` times
    faster on this CPU than the fp16 bit placement (:func:`widen`): timed once per process and pair on
    ``WIDEN_PROBE_ENTRIES`` values, the two taking turns for ``rounds`` rounds, the fastest of each counted.
    PyTorch converts FP8 element by element on AVX2 CPUs (the placement was 8-10x faster there) but has
    vectorised conversions in its AVX-512 builds, so neither is assumed."""
    q = (torch.randn(WIDEN_PROBE_ENTRIES, generator=torch.Generator().manual_seed(0)) * 8).to(fp8_dtype)
    native, placed = (lambda: q.to(dtype)), (lambda: _placed_widening(q, dtype))
    native(), placed()  # warm-up
    times = [(_seconds(native), _seconds(placed)) for _ in range(rounds)]
    return NATIVE_WIDENING_MARGIN * min(t[0] for t in times) < min(t[1] for t in times)


def widen(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The exact ``dtype`` (fp32, bf16, fp16) values of the FP8 tensor ``q``: ``q.to(dtype)``, faster.

    PyTorch converts E4M3 element by element on a CPU (~2.5-3 ns each on 2 cores). Here, on a CPU,
    each E4M3 byte is placed in an fp16 bit pattern (sign to bit 15, exponent and mantissa to bits
    13..7), which reads as the value / 256 for normal and subnormal E4M3 values alike (fp16 has 3 more
    exponent bits and its own subnormals); fp16 is widened and multiplied by 256, all exact and
    vectorised (6.3 M entries: ~5 ms to fp32 against ~15-20). A tensor holding NaN codes (which this
    placement would turn into 480) takes PyTorch's conversion. An E5M2 byte is the top byte of an
    fp16 (its infinities and NaN included) and is placed there the same way (to bf16: 4.7 against
    7.1 ms). A GEMM of widened operands leaves the x 256 to the product's scale instead
    (:func:`dequantised_matmul`).
    """
    wide, factor = _widen_over(q, dtype)
    return wide.mul_(factor) if factor != 1.0 else wide


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


SCALED_MM = "torch._scaled_mm"
DEQUANTISED = "dequantised"
BF16_MARGIN = 1.2  # bf16 GEMMs are used only when at least this much faster than fp32 ones


def fp8_gemm_path(device: torch.device) -> str:
    """``SCALED_MM`` (GPUs) or ``DEQUANTISED`` (CPUs): the FP8 GEMM kernel for ``device`` (module docstring)."""
    return DEQUANTISED if device.type == "cpu" else SCALED_MM


@functools.lru_cache(maxsize=1)
def cpu_gemm_probe(n: int = 256, repeats: int = 2) -> dict[torch.dtype, float]:
    """GFLOP/s of an ``n``-cubed fp32 and bf16 GEMM on this CPU (best of ``repeats``), measured once per
    process."""
    return {dtype: measure_matmul_peak(n, dtype, warmup=1, reps=repeats) / 1e9 for dtype in (torch.float32, torch.bfloat16)}


def faster_gemm_dtype(gflops: dict[torch.dtype, float]) -> torch.dtype:
    """bf16 if its GEMM is at least ``BF16_MARGIN`` times faster than fp32's, else fp32."""
    return torch.bfloat16 if gflops[torch.bfloat16] >= BF16_MARGIN * gflops[torch.float32] else torch.float32


def cpu_gemm_dtype() -> torch.dtype:
    """The dtype the CPU's FP8 GEMMs widen their operands to (one-time probe, :func:`cpu_gemm_probe`)."""
    return faster_gemm_dtype(cpu_gemm_probe())


def cpu_compute_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU's dequantised GEMM with ``out_dtype`` results computes in, so its operands are widened
    to it: :func:`cpu_gemm_dtype` for results of that dtype, else fp32 (:func:`dequantised_matmul`'s rule)."""
    gemm = cpu_gemm_dtype()
    return gemm if gemm == out_dtype else torch.float32


def dequantised_matmul(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
                       out_dtype: torch.dtype, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch._scaled_mm(a, b, a_scale_inv, b_scale_inv, out_dtype)`` as a plain GEMM, any layout.

    ``a`` and ``b`` (FP8) are widened exactly to ``compute_dtype`` (fp32, or bf16 for a bf16
    ``out_dtype``; fp32 otherwise) and multiplied with fp32 accumulation; then the scales. Per tensor
    (one value each): in a bf16 GEMM their product (with the widening's power of two) is the GEMM's
    ``alpha``, which scales the fp32 accumulator before its one rounding to bf16 (no pass over the
    result; 74% of bf16 results were bit-equal to the fp32 product scaled and rounded once when the
    scales multiplied the rounded bf16 product afterwards, >99.99% with ``alpha``); an fp32 product is
    multiplied in place, in one pass (bit for bit ``(A @ B) * s``, which an fp32 ``alpha`` is not).
    Per row of ``a`` and per column of ``b`` (``[M, 1]``, ``[1, N]``), the product is widened to fp32
    and multiplied by each.
    """
    if compute_dtype != torch.float32 and out_dtype != compute_dtype:
        compute_dtype = torch.float32
    (wide_a, fa), (wide_b, fb) = _widen_over(a, compute_dtype), _widen_over(b, compute_dtype)
    widening = fa * fb
    per_tensor = a_scale_inv.numel() == 1 and b_scale_inv.numel() == 1
    if per_tensor and compute_dtype != torch.float32:  # the scales as the GEMM's fp32 alpha: rounded once
        alpha = float(a_scale_inv.float().reshape(()) * b_scale_inv.float().reshape(())) * widening
        if alpha == torch.tensor(alpha, dtype=torch.float32).item():  # an fp32 value (no overflow, no underflow)
            return torch.addmm(wide_a.new_zeros(()), wide_a, wide_b, beta=0, alpha=alpha)
    out = wide_a @ wide_b  # = the exact product / widening: a power of two, so no rounding differs
    if per_tensor:  # a 0-dim fp32 factor: fp32 math, no temporaries
        factor = (a_scale_inv.float() * b_scale_inv.float()).reshape(())
        if widening != 1.0 and bool(torch.isfinite(factor * widening)):  # folded into the scale (unless it overflows)
            factor, widening = factor * widening, 1.0
        if widening != 1.0:
            out.mul_(widening)
        return out.mul_(factor).to(out_dtype)  # (faster than a mixed-dtype multiply into out_dtype)
    if widening != 1.0:
        out.mul_(widening)
    return out.float().mul_(a_scale_inv.float()).mul_(b_scale_inv.float()).to(out_dtype)


_REFUSALS: dict[str, str] = {}  # device -> why torch._scaled_mm refused it there (then not asked again)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it does not start at a 16-byte boundary: cuBLAS refuses a scale pointer inside
    another tensor (an H200 refused ``scale_inv[1]``, 4 bytes in); fresh tensors are aligned."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
              out_dtype: torch.dtype) -> tuple[torch.Tensor | None, str | None]:
    """``torch._scaled_mm`` with per-tensor scales (0-dim, 16-byte aligned): ``(out, None)``, or
    ``(None, reason)`` when this torch/cuBLAS refuses it; a device that refused once is not asked again."""
    key = str(a.device)
    if key in _REFUSALS:
        return None, _REFUSALS[key]
    try:
        return torch._scaled_mm(a, b, scale_a=_aligned(a_scale_inv.float().reshape(())),
                                scale_b=_aligned(b_scale_inv.float().reshape(())), out_dtype=out_dtype), None
    except RuntimeError as err:
        _REFUSALS[key] = f"torch._scaled_mm refused it here ({str(err).splitlines()[0][:160]})"
        return None, _REFUSALS[key]


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, str | None]:
    """``(a * a_scale_inv) @ (b * b_scale_inv)`` for FP8 ``a [M, K]`` and ``b [K, N]``.

    On a CPU: :func:`dequantised_matmul` (any layout). Elsewhere ``torch._scaled_mm`` (:func:`scaled_mm`)
    when the operands are eligible and the installed cuBLAS runs it; otherwise the dequantised matmul
    (the same numbers up to accumulation order), in bf16 for a bf16 result. Returns ``(out, reason)``
    where ``reason`` is None when the device's FP8 path ran and says why ``torch._scaled_mm`` could not
    run otherwise.
    """
    if a.numel() == 0 or b.numel() == 0:  # an MoE expert without tokens: the exact (empty or zero) product,
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device), None  # no kernel asked
    if fp8_gemm_path(a.device) == DEQUANTISED:
        return dequantised_matmul(a, b, a_scale_inv, b_scale_inv, out_dtype, cpu_compute_dtype(out_dtype)), None
    reason = scaled_mm_blocker(a, b)
    if reason is None:
        out, reason = scaled_mm(a, b, a_scale_inv, b_scale_inv, out_dtype)
        if out is not None:
            return out, None
    return dequantised_matmul(a, b, a_scale_inv, b_scale_inv, out_dtype, torch.bfloat16), reason
