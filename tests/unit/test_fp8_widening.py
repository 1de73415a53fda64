"""``widen``: the CPU's conversion of FP8 operands to the dtype of the dequantised GEMM
(:mod:`megatron_lite.precision.fp8_ops`). Every E4M3 and E5M2 bit pattern widens exactly (bf16,
fp16, fp32; contiguous, strided, transposed, in chunks), -0 stays -0, a NaN code is never read as a
number, and the one-time probe picks PyTorch's conversion only where it is faster. The GEMMs that use
it: test_fp8_cpu_gemm.py."""

import pytest
import torch

from megatron_lite.precision import fp8_ops
from megatron_lite.precision.fp8_ops import E4M3, E5M2


@pytest.fixture(autouse=True)
def bit_placement(monkeypatch):
    """The fp16 bit placement is what these tests check, whichever conversion this CPU's probe prefers."""
    monkeypatch.setattr(fp8_ops, "cpu_native_widening", lambda fp8_dtype, dtype: False)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_every_fp8_value_widens_exactly_to_bf16(dtype):
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[~values.isnan()]
    assert torch.equal(values.to(dtype).to(torch.bfloat16).float(), values)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("wide", [torch.float32, torch.bfloat16, torch.float16])
def test_widen_equals_pytorchs_conversion_for_every_bit_pattern(dtype, wide):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = codes[~codes.float().isnan()]
    reversed_ = finite.view(torch.uint8).flip(0).view(dtype)
    for q in (finite, reversed_[::3], finite.view(2, -1).t()):  # contiguous, strided, transposed
        got = fp8_ops.widen(q, wide)
        assert got.dtype == wide and torch.equal(got, q.to(wide))
        assert torch.equal(got.signbit(), q.to(wide).signbit())  # -0 stays -0
    with_nan = fp8_ops.widen(codes, wide)  # NaN codes present: PyTorch's own conversion
    assert torch.equal(with_nan.isnan(), codes.float().isnan())
    assert torch.equal(with_nan[~with_nan.isnan()], finite.to(wide))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("wide", [torch.float32, torch.bfloat16, torch.float16])
def test_widening_in_chunks_keeps_every_value_and_the_layout(dtype, wide, monkeypatch):
    # 7 entries per chunk (bf16 widens in chunks): ~248 codes make 35 chunks and a short tail, in memory order
    monkeypatch.setattr(fp8_ops, "WIDEN_CHUNK", 7)
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = codes[~codes.float().isnan()]
    rows = finite[: finite.numel() // 8 * 8].view(8, -1)
    for q in (finite, rows, rows.t(), rows[:, ::2]):  # contiguous, 2-D, transposed, strided (no chunks)
        got = fp8_ops.widen(q, wide)
        assert torch.equal(got, q.to(wide)) and torch.equal(got.signbit(), q.to(wide).signbit())
        assert got.stride() == q.contiguous().stride() or got.stride() == q.stride()
    assert fp8_ops.widen(rows.t(), wide).stride() == rows.t().stride()  # a transposed operand stays transposed


def test_a_cpu_whose_own_conversion_is_faster_widens_with_it(monkeypatch):
    """The probe's verdict picks the widening: PyTorch's conversion (the same values, no placement run)
    or the placement; the probe switches only for a conversion NATIVE_WIDENING_MARGIN times faster,
    taking the fastest of alternating rounds; it is measured once per process and pair."""
    q = torch.arange(256, dtype=torch.uint8).view(E5M2)[:120]
    placed = []
    real_placed = fp8_ops._placed_widening
    monkeypatch.setattr(fp8_ops, "_placed_widening", lambda t, d: placed.append(d) or real_placed(t, d))
    monkeypatch.setattr(fp8_ops, "cpu_native_widening", lambda fp8_dtype, dtype: True)
    assert torch.equal(fp8_ops.widen(q, torch.bfloat16), q.to(torch.bfloat16)) and not placed
    monkeypatch.setattr(fp8_ops, "cpu_native_widening", lambda fp8_dtype, dtype: False)
    assert torch.equal(fp8_ops.widen(q, torch.bfloat16), q.to(torch.bfloat16)) and placed == [torch.bfloat16]

    monkeypatch.undo()  # the real probe back (the fixture's replacement too)
    probe = fp8_ops.cpu_native_widening
    for native, placement, verdict in ((1.0, 1.3, True), (1.0, 1.2, False), (2.0, 1.0, False)):
        times = iter([native, placement] * 2 + [9.0, 9.0] * 3)  # two fast rounds, three slow ones
        monkeypatch.setattr(fp8_ops, "_seconds", lambda run, times=times: next(times))
        assert probe.__wrapped__(E4M3, torch.bfloat16) is verdict
    monkeypatch.undo()
    probe(E4M3, torch.bfloat16)
    assert probe.cache_info().currsize >= 1 and probe(E4M3, torch.bfloat16) in (True, False)
    hits = probe.cache_info().hits
    probe(E4M3, torch.bfloat16)
    assert probe.cache_info().hits == hits + 1  # measured once per process


@pytest.mark.parametrize("nan_code", [0x7F, 0xFF])
@pytest.mark.parametrize("wide", [torch.float32, torch.bfloat16])
def test_one_e4m3_nan_code_among_numbers_is_seen(nan_code, wide):
    """Each NaN code alone (0x7F is the largest int8, 0xFF the largest uint8) sends the tensor to
    PyTorch's conversion: the fp16 placement would read it as a number (+-480)."""
    codes = torch.tensor([0x00, 0x38, 0xB8, 0x7E, 0xFE, nan_code], dtype=torch.uint8)
    got = fp8_ops.widen(codes.view(E4M3), wide)
    assert got[-1].isnan() and not got[:-1].isnan().any()
    assert torch.equal(got[:-1], codes[:-1].view(E4M3).to(wide))
