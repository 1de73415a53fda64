"""Block-scaled FP8 (``--fp8-recipe blockwise`` and ``mxfp8``): the scale formulas, quantisation round
trips, the point of block scaling (an outlier coarsens only its own block), and the three GEMMs of an
FP8 linear against a reference written straight from the recipes' definitions (a Python loop over
blocks in float64), forward and backward."""

import math

import pytest
import torch

from megatron_lite.precision.fp8 import Fp8Gemm, Fp8Recipe, update_fp8_scales
from megatron_lite.precision.fp8_block import BlockFp8, e8m0_exponent, pow2_block_scale, quantize_blocks
from megatron_lite.precision.fp8_ops import E4M3, E5M2, FP8_MAX

SIZE = {"blockwise": 128, "mxfp8": 32}


def _rand(shape, seed, std=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


# -- the scale of one block ----------------------------------------------------------------------------
def test_blockwise_scale_is_fp8_max_over_amax_rounded_down_to_a_power_of_two():
    amax = torch.tensor([1.0, 3.5, 448.0, 500.0, 1e-3, 0.0, float("inf"), float("nan"), 1e-45])
    want = [256.0, 128.0, 1.0, 0.5, 2.0**18, 1.0, 1.0, 1.0, 2.0**127]  # 448/1e-3 = 448000 -> 2^18
    assert pow2_block_scale(amax, 448.0).tolist() == want
    assert pow2_block_scale(torch.tensor([1.0]), 57344.0).tolist() == [32768.0]  # E5M2's max


def test_mxfp8_exponent_is_log2_of_amax_over_fp8_max_rounded_up():
    amax = torch.tensor([448.0, 449.0, 224.0, 1.0, 0.0, float("inf"), 1e30, 1e-45])
    want = [0, 1, -1, -8, -127, 127, 91, -127]  # ceil(log2(1/448)) = ceil(-8.81) = -8; 1e30/448 ~ 2^90.8
    assert e8m0_exponent(amax, 448.0).tolist() == want
    # the block's largest value fits: amax / 2^e <= 448, and 2^(e-1) would not fit
    e = e8m0_exponent(torch.tensor([3.7]), 448.0).item()
    assert 3.7 / 2.0**e <= 448 < 3.7 / 2.0 ** (e - 1)


# -- quantisation ------------------------------------------------------------------------------------
def _ref_quantize(x, block, recipe, dtype=E4M3):
    """Dequantised values (float64), one block at a time from the formula."""
    fmax, (br, bc) = FP8_MAX[dtype], block
    out = torch.empty_like(x, dtype=torch.float64)
    for i in range(0, x.shape[0], br):
        for j in range(0, x.shape[1], bc):
            blk = x[i:i + br, j:j + bc].double()
            amax = blk.abs().max().item()
            if recipe == "blockwise":
                scale = 1.0 if amax == 0 else 2.0 ** math.floor(math.log2(fmax / amax))
            else:
                scale = 2.0**127 if amax == 0 else 2.0 ** -max(-127, math.ceil(math.log2(amax / fmax)))
            q = (blk * scale).clamp(-fmax, fmax).float().to(dtype).double()
            out[i:i + br, j:j + bc] = q / scale
    return out


@pytest.mark.parametrize("recipe, block", [("blockwise", (1, 128)), ("blockwise", (128, 128)), ("mxfp8", (1, 32))])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantisation_equals_the_formula_with_partial_blocks(recipe, block, dtype):
    # 200 x 300: whole and partial blocks in both dimensions; magnitudes from 1e-4 to 1e3 by row
    x = _rand((200, 300), 0) * torch.logspace(-4, 3, 200)[:, None]
    q = quantize_blocks(x, block, recipe, dtype)
    assert q.data.dtype == dtype and q.scale_inv.shape == (math.ceil(200 / block[0]), math.ceil(300 / block[1]))
    assert torch.equal(q.dequantize(torch.float64), _ref_quantize(x, block, recipe, dtype))
    # a partial block is the zero-padded block: same values, same scales
    padded = torch.nn.functional.pad(x, (0, -300 % block[1], 0, -200 % block[0]))
    p = quantize_blocks(padded, block, recipe, dtype)
    assert torch.equal(p.scale_inv, q.scale_inv) and torch.equal(p.data[:200, :300].float(), q.data.float())
    # a transposed view (an expert's weight slice, a wgrad operand) quantises like its contiguous copy
    xt = torch.nn.functional.pad(x, (0, -300 % 128, 0, -200 % 128)).t().contiguous().t()  # 256 x 384: no partial block
    assert torch.equal(quantize_blocks(xt, block, recipe, dtype).dequantize(), _ref_quantize(xt, block, recipe, dtype))


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_round_trip_is_exact_for_fp8_values_and_within_e4m3_precision_otherwise(recipe):
    size = SIZE[recipe]
    # values that are E4M3 numbers times a power of two per block come back exactly
    base = _rand((4, 2 * size), 1).to(E4M3).float() * torch.tensor([1.0, 2.0**-20, 2.0**10, 0.5])[:, None]
    assert torch.equal(quantize_blocks(base, (1, size), recipe).dequantize(), base)
    x = _rand((64, 4 * size), 2)
    back = quantize_blocks(x, (1, size), recipe).dequantize()
    rel = ((back - x).abs() / x.abs().clamp_min(1e-30))
    assert rel[x.abs() > 0.05].max() <= 2.0**-4  # E4M3's half ulp, relative (no value in subnormal range)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_an_outlier_coarsens_only_its_own_block(recipe):
    size = SIZE[recipe]
    x = _rand((3, 3 * size), 3)
    spiked = x.clone()
    spiked[1, size + 5] = 3e4  # in row 1's second block
    a, b = quantize_blocks(x, (1, size), recipe), quantize_blocks(spiked, (1, size), recipe)
    other = torch.ones(3, 3, dtype=torch.bool)
    other[1, 1] = False
    assert torch.equal(a.scale_inv[other], b.scale_inv[other])  # every other block: the same scale
    same = torch.ones_like(x, dtype=torch.bool)
    same[1, size:2 * size] = False
    assert torch.equal(a.data.float()[same], b.data.float()[same])
    assert b.scale_inv[1, 1] > 2**6 * a.scale_inv[1, 1]  # its own block lost ~6 binades of precision
    # one scale per tensor (tensorwise) would have flushed the small values of every block
    tensorwise = (x * (448.0 / 3e4)).to(E4M3)
    assert (tensorwise == 0).sum() > 0 and (b.data.float()[same] == 0).sum() == 0


def test_weight_tiles_are_128_by_128():
    w = _rand((256, 256), 4)
    spiked = w.clone()
    spiked[3, 200] = 1e4  # tile (0, 1)
    a, b = quantize_blocks(w, (128, 128), "blockwise"), quantize_blocks(spiked, (128, 128), "blockwise")
    changed = (a.scale_inv != b.scale_inv).nonzero().tolist()
    assert changed == [[0, 1]]


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_an_all_zero_block_stays_zero_without_nan(recipe):
    size = SIZE[recipe]
    x = _rand((2, 2 * size), 5)
    x[0, :size] = 0
    q = quantize_blocks(x, (1, size), recipe)
    want = 1.0 if recipe == "blockwise" else 2.0**-127  # TE: scale 1; E8M0 exponent -127
    assert q.scale_inv[0, 0].item() == want and torch.isfinite(q.scale_inv).all()
    assert torch.equal(q.dequantize()[0, :size], torch.zeros(size))
    if recipe == "mxfp8":
        assert q.e8m0().dtype == torch.float8_e8m0fnu and torch.equal(q.e8m0().float(), q.scale_inv)


# -- the three GEMMs ---------------------------------------------------------------------------------
def _reference(x, w, dy, recipe, fmt):
    """Y = X W^T, dX = dY W, dW = dY^T X, each operand quantised along that GEMM's reduction dimension."""
    s, g = SIZE[recipe], E5M2 if fmt == "hybrid" else E4M3
    if recipe == "blockwise":
        w_fwd = w_bwd = _ref_quantize(w, (s, s), recipe)
    else:
        w_fwd, w_bwd = _ref_quantize(w, (1, s), recipe), _ref_quantize(w.t(), (1, s), recipe).t()
    y = _ref_quantize(x, (1, s), recipe) @ w_fwd.t()
    dx = _ref_quantize(dy, (1, s), recipe, g) @ w_bwd
    dw = _ref_quantize(dy.t(), (1, s), recipe, g) @ _ref_quantize(x.t(), (1, s), recipe).t()
    return y, dx, dw


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_linear_forward_and_backward_equal_the_formula(recipe, fmt):
    # dims with whole and partial blocks; tokens with very different magnitudes (per-token outliers)
    m, k, n = (200, 300, 260) if recipe == "blockwise" else (72, 100, 80)
    x = (_rand((m, k), 6) * torch.logspace(-2, 2, m)[:, None]).requires_grad_()
    # even input features ~1e6 x larger than odd ones: blocks along the input features flush the odd ones,
    # blocks along the output features (dgrad's) keep them, so which way the weight is blocked shows
    w = (_rand((n, k), 7, 0.05) * torch.where(torch.arange(k) % 2 == 0, 1.0, 1e-6)).requires_grad_()
    b = _rand(n, 8).requires_grad_()
    dy = _rand((m, n), 9, 1e-3) * torch.logspace(0, 3, n)
    gemm = Fp8Gemm(Fp8Recipe(format=fmt, recipe=recipe))
    y = gemm(x, w, b)
    y.backward(dy)
    want_y, want_dx, want_dw = _reference(x.detach(), w.detach(), dy, recipe, fmt)
    for got, want in ((y - b, want_y), (x.grad, want_dx), (w.grad, want_dw)):
        # fp32 summation order: 1e-5 relative to each output column's largest value (columns differ by 1e6)
        err, allowed = (got.double() - want).abs(), 1e-5 * (want.abs() + want.abs().amax(0, keepdim=True))
        assert (err <= allowed).all(), f"worst excess {(err / allowed).max():.3g}"
    torch.testing.assert_close(b.grad, dy.sum(0))
    assert not gemm.fallbacks


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_bf16_linear_equals_the_formula_within_one_bf16_rounding(recipe):
    x = _rand((64, 96), 10).bfloat16().requires_grad_()
    w = _rand((48, 96), 11, 0.1).bfloat16().requires_grad_()
    dy = _rand((64, 48), 12, 1e-2).bfloat16()
    y = Fp8Gemm(Fp8Recipe(format="hybrid", recipe=recipe))(x, w)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    want = _reference(x.detach().float(), w.detach().float(), dy.float(), recipe, "hybrid")
    for got, ref in zip((y, x.grad, w.grad), want):
        torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def test_no_fp8_wgrad_runs_the_weight_gradient_in_high_precision():
    x, w, dy = _rand((40, 64), 13).requires_grad_(), _rand((32, 64), 14).requires_grad_(), _rand((40, 32), 15)
    Fp8Gemm(Fp8Recipe(recipe="mxfp8", wgrad=False))(x, w).backward(dy)
    torch.testing.assert_close(w.grad, dy.t() @ x.detach())


def test_block_recipes_keep_no_scaling_state_and_load_other_recipes_checkpoints():
    delayed = Fp8Gemm(Fp8Recipe(recipe="delayed"))
    x, w = _rand((32, 64), 16).requires_grad_(), _rand((32, 64), 17).requires_grad_()
    delayed(x, w).sum().backward()
    update_fp8_scales(delayed)
    for recipe in ("blockwise", "mxfp8"):
        gemm = Fp8Gemm(Fp8Recipe(recipe=recipe, amax_history_len=4))  # the history length is ignored, as Megatron
        before = {k: v.clone() for k, v in gemm.state_dict().items()}
        for _ in range(2):
            gemm(x, w).sum().backward()
        assert update_fp8_scales(gemm) == 0
        assert all(torch.equal(v, before[k]) for k, v in gemm.state_dict().items())  # untouched: nothing learned
        Fp8Gemm(Fp8Recipe(recipe=recipe)).load_state_dict(delayed.state_dict())  # same keys: loads
        delayed.load_state_dict(Fp8Gemm(Fp8Recipe(recipe=recipe)).state_dict())


def test_block_fp8_transpose_keeps_blocks_with_their_values():
    x = _rand((40, 70), 18)
    q = quantize_blocks(x, (1, 32), "mxfp8")
    t = q.t()
    assert isinstance(t, BlockFp8) and t.block == (32, 1) and torch.equal(t.dequantize(), q.dequantize().t())


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_an_expert_without_tokens_gets_empty_outputs_and_a_zero_weight_gradient(recipe):
    x, w = torch.zeros(0, 64, requires_grad=True), _rand((32, 64), 19).requires_grad_()
    y = Fp8Gemm(Fp8Recipe(recipe=recipe))(x, w)
    y.sum().backward()
    assert y.shape == (0, 32) and x.grad.shape == (0, 64) and torch.equal(w.grad, torch.zeros(32, 64))


def test_startup_line_names_the_block_recipe_and_its_gemms(monkeypatch):
    from megatron_lite.precision import fp8_describe as fp8_module
    line = fp8_module.describe_fp8_path(Fp8Recipe(format="e4m3", recipe="mxfp8"), torch.device("cpu"))
    assert "e4m3 (E4M3 forward, E4M3 gradients), mxfp8 scaling (1x32 blocks" in line
    monkeypatch.setattr(fp8_module, "fp8_gemm_path", lambda device: fp8_module.SCALED_MM)  # as on a GPU
    line = fp8_module.describe_fp8_path(Fp8Recipe(recipe="blockwise"), torch.device("cpu"))
    assert "blockwise scaling" in line and "dequantised matmuls" in line and "_scaled_mm" not in line


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_evaluation_gives_the_training_forward(recipe):
    x, w, b = _rand((2, 40, 64), 20), _rand((48, 64), 21), _rand(48, 22)
    gemm = Fp8Gemm(Fp8Recipe(recipe=recipe))
    with torch.no_grad():
        evaluated = gemm(x, w, b)
    trained = gemm(x.requires_grad_(), w, b)
    assert evaluated.shape == (2, 40, 48) and torch.equal(evaluated, trained.detach())
