"""The CPU's FP8 GEMM: exact dequantised GEMMs instead of the emulated ``torch._scaled_mm``.

What makes it exact: every E4M3 and E5M2 value is a bf16 and an fp32 value (checked for all 256
bit patterns, also through ``widen``, the CPU's fast E4M3 conversion: test_fp8_widening.py), a product of two FP8 values is exact in fp32, and both GEMMs accumulate in fp32. So
the dequantised GEMM must equal ``torch._scaled_mm`` (CPU) up to fp32 summation order for fp32
results (rtol 1e-5), and within one bf16 rounding for bf16 results (rtol 2^-7: where the scales
are not the bf16 GEMM's alpha, it rounds its accumulator before they are applied), for every operand pair the recipes
use (fprop E4M3 x E4M3; dgrad and wgrad E5M2 x E4M3 in ``hybrid``, E4M3 x E4M3 in ``e4m3``), with
per-tensor scales that are not powers of two, and with row-wise scales.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.precision import fp8, fp8_ops
from megatron_lite.precision.fp8 import Fp8Gemm, Fp8Recipe, update_fp8_scales
from megatron_lite.precision.fp8_describe import describe_fp8_path
from megatron_lite.precision.fp8_ops import E4M3, E5M2, quantize


@pytest.fixture(autouse=True)
def bit_placement(monkeypatch):
    """The fp16 bit placement is what these tests check, whichever conversion this CPU's probe prefers."""
    monkeypatch.setattr(fp8_ops, "cpu_native_widening", lambda fp8_dtype, dtype: False)

M, K, N = 32, 64, 48
BF16_ROUNDING = 2.0**-7  # one bf16 unit in the last place, relative, at worst


def _rand(shape, seed, std=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amax_is_the_largest_magnitude_and_propagates_nan_and_inf(dtype):
    x = _rand((37, 53), 3, std=5.0).to(dtype)
    x[4, 7] = -30.0  # the largest magnitude is negative
    assert fp8_ops.amax(x).dtype == torch.float32 and fp8_ops.amax(x).item() == 30.0
    assert fp8_ops.amax(x.t()).item() == 30.0
    x[1, 1] = -float("inf")
    assert fp8_ops.amax(x).item() == float("inf")
    x[2, 2] = float("nan")
    assert fp8_ops.amax(x).isnan()
    assert fp8_ops.amax(x[:0]).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_quantize_is_the_fp32_product_clamped_and_cast(dtype, fp8):
    x = _rand((64, 48), 4, std=300.0).to(dtype)
    scale = torch.tensor(1.7319)  # not a power of two: the fp32 product is rounded once, as in the formula
    limit = fp8_ops.FP8_MAX[fp8]
    want = (x.float() * scale).clamp(-limit, limit).to(fp8)
    before = x.clone()
    assert torch.equal(quantize(x, scale, fp8).view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(x, before)  # the caller's tensor is left alone (fp32: no in-place scaling)


class _CountClamps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.clamps = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.clamps += func.overloadpacket in (torch.ops.aten.clamp, torch.ops.aten.clamp_)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("saturates", [False, True], ids=["fits", "saturates"])
def test_quantize_skips_the_clamp_only_when_the_known_amax_fits(fp8, saturates):
    """With ``amax(x)`` given, a CPU clamps only when ``amax * scale`` exceeds the format's maximum:
    the same bytes either way, one pass fewer when nothing can saturate. A NaN amax clamps."""
    x = _rand((64, 48), 7, std=fp8_ops.FP8_MAX[fp8] if saturates else 0.5).to(torch.bfloat16)
    scale = torch.tensor(1.7319)
    want = quantize(x, scale, fp8).view(torch.uint8)
    with _CountClamps() as mode:
        got = quantize(x, scale, fp8, fp8_ops.amax(x)).view(torch.uint8)
    assert torch.equal(got, want)
    assert mode.clamps == saturates
    edge = x.float() / fp8_ops.amax(x) * fp8_ops.FP8_MAX[fp8]  # amax x scale is exactly the maximum
    with _CountClamps() as mode:
        got = quantize(edge, torch.tensor(1.0), fp8, fp8_ops.amax(edge))
    assert mode.clamps == 0 and torch.equal(got.view(torch.uint8), quantize(edge, torch.tensor(1.0), fp8).view(torch.uint8))
    with _CountClamps() as mode:
        quantize(x, scale, fp8, torch.tensor(float("nan")))
    assert mode.clamps == 1


def _e4m3_with_subnormals(shape, seed):
    """E4M3 operands over the whole range: normals, subnormals, zeros of both signs, the maximum."""
    codes = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    codes[codes.bitwise_and(0x7F) == 0x7F] = 0x7E  # no NaN codes (448 instead)
    return codes.view(E4M3)


@pytest.mark.parametrize("b_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_widenings_x256_folded_into_the_scale_changes_no_bit(b_dtype, out_dtype):
    """The CPU's dequantised GEMM multiplies the widened E4M3 operands' x 256 into the result's scale
    instead of into each operand: a power of two, so the result equals ``(widen(a) @ widen(b)) * s``
    rounded once to ``out_dtype``, bit for bit, over the whole E4M3 range; where the folded scale would
    overflow fp32 the operands' way is taken (same numbers)."""
    a = _e4m3_with_subnormals((M, K), 8)
    b = _e4m3_with_subnormals((K, N), 9) if b_dtype == E4M3 else quantize(_rand((K, N), 9), torch.tensor(1e3), E5M2)
    for sa, sb in ((torch.tensor(0.0123), torch.tensor(1 / 3.0)), (torch.tensor(3e38), torch.tensor(1e-20))):
        want = ((fp8_ops.widen(a, torch.float32) @ fp8_ops.widen(b, torch.float32)) * (sa * sb)).to(out_dtype)
        got = fp8_ops.dequantised_matmul(a, b, sa, sb, out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, want)
    sa = torch.tensor(3e38)  # x 256 x 256 overflows fp32: the fold is not taken
    small = torch.full((M, K), 2.0**-9).to(E4M3)  # the smallest E4M3 subnormal
    want = ((fp8_ops.widen(small, torch.float32) @ fp8_ops.widen(b, torch.float32)) * (sa * torch.tensor(1.0)))
    assert torch.equal(fp8_ops.dequantised_matmul(small, b, sa, torch.tensor(1.0), torch.float32), want)


def test_the_bf16_gemm_applies_the_scales_before_its_one_rounding():
    """Per-tensor scales are the bf16 GEMM's ``alpha``: the fp32 accumulator is scaled, then rounded
    once, as ``torch._scaled_mm`` rounds. Scaling the rounded bf16 product afterwards (two roundings)
    matches the once-rounded value in ~3/4 of the entries only. Where the scales with the widening's
    power of two are not an fp32 value, the scales multiply the product instead (same numbers within
    one bf16 rounding)."""
    a, b = _e4m3_with_subnormals((M, K), 8), _e4m3_with_subnormals((N, K), 9).t()
    wide_product = fp8_ops.widen(a, torch.float32) @ fp8_ops.widen(b, torch.float32)  # exact products, fp32 sums
    sa, sb = torch.tensor(0.0123), torch.tensor(1 / 3.0)
    once = (wide_product * (sa * sb)).to(torch.bfloat16)
    got = fp8_ops.dequantised_matmul(a, b, sa, sb, torch.bfloat16, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert (got == once).float().mean() >= 0.99
    torch.testing.assert_close(got, once, rtol=BF16_ROUNDING, atol=0)
    sa = torch.tensor(3e38)  # x 256 x 256 overflows fp32: no alpha
    want = (wide_product * (sa * sb)).to(torch.bfloat16)
    torch.testing.assert_close(fp8_ops.dequantised_matmul(a, b, sa, sb, torch.bfloat16, torch.bfloat16), want,
                               rtol=BF16_ROUNDING, atol=0)


PAIRS = {"fprop E4M3 x E4M3": (E4M3, E4M3), "hybrid dgrad/wgrad E5M2 x E4M3": (E5M2, E4M3)}


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_dequantised_matmul_equals_scaled_mm(pair, out_dtype, compute_dtype, scaling):
    da, db = PAIRS[pair]
    a8 = quantize(_rand((M, K), 1), torch.tensor(40.0), da)
    b8 = quantize(_rand((N, K), 2), torch.tensor(300.0), db).t()  # column-major, as the kernel wants
    if scaling == "tensor":
        sa, sb = torch.tensor(1 / 40.0), torch.tensor(0.0123)
    else:
        sa, sb = _rand((M, 1), 3).abs() + 0.1, _rand((1, N), 4).abs() + 0.1
    want = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    got = fp8_ops.dequantised_matmul(a8, b8, sa, sb, out_dtype, compute_dtype)
    assert got.dtype == out_dtype
    rtol = 1e-5 if out_dtype == torch.float32 else BF16_ROUNDING
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6 * want.abs().max().item())
    if compute_dtype == torch.float32 or out_dtype == torch.float32:  # the fp32 GEMM: summation order only
        exact = (a8.float() @ b8.float()) * sa * sb
        torch.testing.assert_close(got, exact.to(out_dtype), rtol=rtol, atol=1e-6 * want.abs().max().item())


def test_layouts_do_not_matter_on_cpu():
    """The wgrad operands as views (``dY8^T``, ``X8``) give the product of the kernel's layouts."""
    dy8, x8 = quantize(_rand((M, N), 5), torch.tensor(1e3), E5M2), quantize(_rand((M, K), 6), torch.tensor(50.0), E4M3)
    one = torch.tensor(0.37)
    views = fp8_ops.dequantised_matmul(dy8.t(), x8, one, one, torch.float32)
    kernel = torch._scaled_mm(dy8.t().contiguous(), fp8_ops.column_major(x8), scale_a=one, scale_b=one,
                              out_dtype=torch.float32)
    torch.testing.assert_close(views, kernel, rtol=1e-5, atol=1e-6 * kernel.abs().max().item())


def _train_two_steps(fmt, dtype, bias=True, fallbacks=None):
    """Output and gradients of an FP8 linear at its second step (delayed scales learnt at step 1).
    ``fallbacks``: a dict that receives the GEMMs that fell back (default: none may)."""
    gemm = Fp8Gemm(Fp8Recipe(format=fmt))
    x, w, b, dy = _rand((16, 2, K), 1), _rand((N, K), 2, 0.05), _rand(N, 3, 0.1), _rand((16, 2, N), 4, 1e-3)
    for _ in range(2):
        xr, wr, br = (t.to(dtype).requires_grad_() for t in (x, w, b))
        y = gemm(xr, wr, br if bias else None)
        y.backward(dy.to(dtype))
        update_fp8_scales(gemm)
    if fallbacks is None:
        assert gemm.fallbacks == {}
    else:
        fallbacks.update(gemm.fallbacks)
    return (y.detach(), xr.grad, wr.grad) + ((br.grad,) if bias else ())


@pytest.fixture
def scaled_mm_on_cpu(monkeypatch):
    for module in (fp8, fp8_ops):
        monkeypatch.setattr(module, "fp8_gemm_path", lambda device: fp8_ops.SCALED_MM)


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_cpu_path_equals_scaled_mm_path_and_never_calls_it(fmt, monkeypatch, request):
    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on the CPU path")

    with monkeypatch.context() as m:
        m.setattr(torch, "_scaled_mm", refuse)
        m.setattr(fp8_ops, "cpu_gemm_dtype", lambda: torch.float32)
        cpu = _train_two_steps(fmt, torch.float32)
    request.getfixturevalue("scaled_mm_on_cpu")
    kernel = _train_two_steps(fmt, torch.float32)
    for name, got, want in zip(("output", "dgrad", "wgrad", "bias grad"), cpu, kernel):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item(),
                                   msg=lambda msg, n=name: f"{n}: {msg}")


REFUSED = "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"


def test_a_refused_fp8_kernel_falls_back_once_per_device_with_the_same_numbers(monkeypatch, request):
    """Where torch/cuBLAS refuses ``torch._scaled_mm``, every FP8 GEMM falls back to the dequantised one
    (the same numbers), each GEMM kind says why once, and the device is not asked again."""
    calls = []

    def refuse(a, b, scale_a, scale_b, out_dtype):
        calls.append(tuple(scale_a.shape))
        raise RuntimeError(REFUSED)

    request.getfixturevalue("scaled_mm_on_cpu")
    monkeypatch.setattr(fp8_ops, "_REFUSALS", {})
    reference = _train_two_steps("hybrid", torch.float32)
    assert fp8_ops._REFUSALS == {}
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    fallbacks = {}
    with pytest.warns(UserWarning, match="runs as a dequantised matmul: torch._scaled_mm refused it here"):
        got = _train_two_steps("hybrid", torch.float32, fallbacks=fallbacks)
    assert sorted(fallbacks) == ["dgrad", "fprop", "wgrad"] and all("NOT_SUPPORTED" in r for r in fallbacks.values())
    assert calls == [()]  # asked once per device, then answered at once
    for name, g, want in zip(("output", "dgrad", "wgrad", "bias grad"), got, reference):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6 * want.abs().max().item(),
                                   msg=lambda msg, n=name: f"{n}: {msg}")


def test_bf16_gemms_keep_bf16_results_within_one_rounding(monkeypatch):
    """Where the probe picks bf16 GEMMs (CPUs with bf16 matrix units): bf16 training results within one
    bf16 rounding of the fp32-GEMM path; fp32 results still come from the fp32 GEMM, unchanged. (No bias:
    a bias added to a GEMM output that nearly cancels it would turn one rounding into a large relative one.)"""
    monkeypatch.setattr(fp8_ops, "cpu_gemm_dtype", lambda: torch.float32)
    fp32_gemms = {dtype: _train_two_steps("hybrid", dtype, bias=False) for dtype in (torch.bfloat16, torch.float32)}
    monkeypatch.setattr(fp8_ops, "cpu_gemm_dtype", lambda: torch.bfloat16)
    widenings, real_widen_over = [], fp8_ops._widen_over

    def recording(q, dtype):
        widenings.append((q.dtype, dtype))
        return real_widen_over(q, dtype)

    monkeypatch.setattr(fp8_ops, "_widen_over", recording)
    bf16_gemms = {dtype: _train_two_steps("hybrid", dtype, bias=False) for dtype in (torch.bfloat16, torch.float32)}
    # every operand is widened once, from its FP8 bytes straight to the dtype its GEMM computes in (bf16 for
    # bf16 results, fp32 for fp32 ones): none is widened to one dtype and converted to another afterwards
    assert {(torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float32)} <= set(widenings)
    assert all(src in (torch.float8_e4m3fn, torch.float8_e5m2) or src == dst for src, dst in widenings), widenings
    for got, want in zip(bf16_gemms[torch.bfloat16], fp32_gemms[torch.bfloat16]):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=BF16_ROUNDING, atol=1e-6 * want.abs().max().item())
    for got, want in zip(bf16_gemms[torch.float32], fp32_gemms[torch.float32]):
        assert torch.equal(got, want)


def test_path_is_decided_by_device_and_gemm_dtype_by_probe():
    assert fp8_ops.fp8_gemm_path(torch.device("cpu")) == fp8_ops.DEQUANTISED
    assert fp8_ops.fp8_gemm_path(torch.device("cuda")) == fp8_ops.SCALED_MM
    # figures of the two machine kinds: fp32 fast, bf16 slow (this one) / bf16 matrix units (7x fp32)
    assert fp8_ops.faster_gemm_dtype({torch.float32: 160.0, torch.bfloat16: 1.3}) == torch.float32
    assert fp8_ops.faster_gemm_dtype({torch.float32: 400.0, torch.bfloat16: 2810.0}) == torch.bfloat16
    assert fp8_ops.faster_gemm_dtype({torch.float32: 100.0, torch.bfloat16: 110.0}) == torch.float32  # margin
    probe = fp8_ops.cpu_gemm_probe()
    assert set(probe) == {torch.float32, torch.bfloat16} and min(probe.values()) > 0
    assert fp8_ops.cpu_gemm_probe() is probe  # measured once per process
    line = describe_fp8_path(Fp8Recipe(), torch.device("cpu"))
    chosen = "bf16" if fp8_ops.cpu_gemm_dtype() == torch.bfloat16 else "fp32"
    assert "decided by device" in line and f"exact {chosen} dequantised GEMMs" in line and "one-time probe" in line
    assert "FP8 widened to it by" in line


def test_the_fp8_kernel_gets_scales_at_aligned_addresses(monkeypatch, request):
    """cuBLAS refuses a scale pointer inside another tensor (an H200 refused ``scale_inv[1]``, 4 bytes
    into its tensor, with CUBLAS_STATUS_NOT_SUPPORTED): every scale reaching the kernel starts at a
    16-byte boundary, and a misaligned one is copied, not refused."""
    real, addresses = torch._scaled_mm, []

    def recording(a, b, scale_a, scale_b, out_dtype):
        addresses.extend([scale_a.data_ptr() % 16, scale_b.data_ptr() % 16])
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    request.getfixturevalue("scaled_mm_on_cpu")
    monkeypatch.setattr(fp8_ops, "_REFUSALS", {})
    monkeypatch.setattr(torch, "_scaled_mm", recording)
    _train_two_steps("hybrid", torch.float32)
    assert len(addresses) == 12 and set(addresses) == {0}
    pair = torch.tensor([2.0, 3.0])
    assert fp8_ops._aligned(pair[0]).data_ptr() == pair.data_ptr()  # aligned: used as it is
    moved = fp8_ops._aligned(pair[1])
    assert moved.data_ptr() % 16 == 0 and moved.item() == 3.0 and moved.data_ptr() != pair[1].data_ptr()


def test_the_compiled_cast_writes_the_eager_bytes():
    """On GPUs the cast is one compiled ``jit_fuser`` kernel (CPUs keep the eager operators, faster
    there even under ``--jit-fuser compile``). The same function compiled here: the eager bytes for
    both formats, saturating values, a NaN, and a second shape (compiled with dynamic sizes)."""
    from megatron_lite.fusions import jit

    jit.set_jit_fuser("compile")
    try:
        if jit.compile_unavailable("cpu"):
            pytest.skip(jit.compile_unavailable("cpu"))
        x = _rand((64, 48), 10)
        fp8_ops._scale_and_cast._compiled.clear()
        assert fp8_ops._scale_and_cast.compiles_for(x)
        quantize(x, torch.tensor(1.0), E4M3)
        assert not fp8_ops._scale_and_cast._compiled  # a CPU tensor took the eager route
        for shape in ((64, 48), (40, 96)):
            x = _rand(shape, 10, std=200.0).to(torch.bfloat16)
            x[0, 0] = float("nan")
            for fp8 in (E4M3, E5M2):
                limit = fp8_ops.FP8_MAX[fp8]
                scale = torch.tensor(1.7319 if fp8 == E4M3 else 300.0)
                compiled = fp8_ops._scale_and_cast(x, scale, limit, fp8)
                eager = quantize(x, scale, fp8)
                assert compiled.float()[0, 0].isnan() and eager.float()[0, 0].isnan()
                assert torch.equal(compiled.view(torch.uint8)[1:], eager.view(torch.uint8)[1:])
                assert compiled.float()[1:].abs().max() == limit  # saturated, not inf/NaN
        assert fp8_ops._scale_and_cast._compiled  # it did run compiled
    finally:
        jit.set_jit_fuser("auto")
