"""FP8 GEMM (Fp8Gemm) against an FP8 emulation oracle and an fp32 reference; recipe arithmetic.

Two references:

* the *emulation oracle*: quantise each operand with the expected scale (clamp, cast), dequantise
  to fp32 and run a plain fp32 matmul. The FP8 path must equal it up to fp32 accumulation order
  (rtol 1e-5), which proves the right scales, formats and GEMM operands were used;
* the *fp32 reference* ``F.linear``: the FP8 result must be within FP8 rounding of it. Relative
  Frobenius error bounds: 0.08 where both operands are E4M3 (3 mantissa bits, unit roundoff 2^-4),
  0.15 where the gradient is E5M2 (2 mantissa bits, unit roundoff 2^-3).

The main test runs both GEMM paths: this CPU's (exact dequantised GEMMs) and the GPU's
(``torch._scaled_mm`` with its operand layouts and wgrad padding, forced onto the CPU).

The delayed-scaling test replays the recipe step by step in plain Python (history roll, most_recent
or max, margin, zero amax keeps the old scale) and compares every scale and history entry.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.errors import ConfigError
from megatron_lite.precision import fp8, fp8_ops
from megatron_lite.precision.fp8 import Fp8Gemm, Fp8Recipe, fp8_gemms, update_fp8_scales
from megatron_lite.precision.fp8_ops import (
    E4M3,
    E5M2,
    fp8_matmul,
    quantize,
    roll_amax_history,
    scaled_mm_blocker,
)

S, B, K, N = 16, 2, 64, 48
MAX = {E4M3: 448.0, E5M2: 57344.0}


def _rand(shape, seed, std=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def _inputs():
    return _rand((S, B, K), 1), _rand((N, K), 2, 0.05), _rand(N, 3, 0.1), _rand((S, B, N), 4, 1e-3)


def _q(t, scale, dtype):
    """Reference saturating cast and read-back, written out independently of the implementation."""
    inv = 1.0 / scale
    return (t.float() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype).float() * inv


def _emulate(x, w, b, dy, scales, grad_dtype, wgrad=True):
    """Output and gradients of the FP8 linear, computed in fp32 from dequantised operands."""
    sx, sw, sg = scales
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, N)
    xq, wq, gq = _q(x2, sx, E4M3), _q(w, sw, E4M3), _q(dy2, sg, grad_dtype)
    y = (xq @ wq.t() + b).reshape(S, B, N)
    dx = (gq @ wq).reshape(S, B, K)
    dw = gq.t() @ xq if wgrad else dy2.t() @ x2
    return y, dx, dw, dy2.sum(0)


def _run(gemm, x, w, b, dy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = gemm(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _current(t, fp8_max):
    return torch.tensor(fp8_max) / t.abs().max()


@pytest.fixture
def scaled_mm_on_cpu(monkeypatch):
    """Run the GPU path (``torch._scaled_mm``, its operand layouts and fallbacks) on this CPU."""
    for module in (fp8, fp8_ops):
        monkeypatch.setattr(module, "fp8_gemm_path", lambda device: fp8_ops.SCALED_MM)


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("wgrad", [True, False])
@pytest.mark.parametrize("path", ["device", "scaled_mm"])
def test_forward_backward_match_emulation_and_fp32(fmt, recipe, wgrad, path, request):
    """``device``: this CPU's dequantised GEMMs; ``scaled_mm``: the GPU path's kernel and layouts."""
    if path == "scaled_mm":
        request.getfixturevalue("scaled_mm_on_cpu")
    gemm = Fp8Gemm(Fp8Recipe(format=fmt, recipe=recipe, wgrad=wgrad))
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    x, w, b, dy = _inputs()
    if recipe == "delayed":  # step 1 records the amaxes; step 2 runs with the scales they give
        _run(gemm, x, w, b, dy)
        assert update_fp8_scales(gemm) == 1
    scales = (_current(x, 448.0), _current(w, 448.0), _current(dy, MAX[grad_dtype]))
    got = _run(gemm, x, w, b, dy)
    want = _emulate(x, w, b, dy, scales, grad_dtype, wgrad)
    for name, g, e in zip(("output", "dgrad", "wgrad", "bias grad"), got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6 * e.abs().max().item(), msg=lambda m, n=name: f"{n}: {m}")
    assert gemm.fallbacks == {}
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.linear(xr, wr, b)
    ref.backward(dy)
    bwd_tol = 0.15 if grad_dtype == E5M2 else 0.08
    assert _rel(got[0], ref) < 0.08
    assert _rel(got[1], xr.grad) < bwd_tol
    assert _rel(got[2], wr.grad) < (bwd_tol if wgrad else 1e-6)


def test_bf16_inputs_give_bf16_results_close_to_emulation():
    gemm = Fp8Gemm(Fp8Recipe(recipe="tensorwise"))
    x, w, b, dy = _inputs()
    got = _run(gemm, x.bfloat16(), w.bfloat16(), b.bfloat16(), dy.bfloat16())
    assert [t.dtype for t in got] == [torch.bfloat16] * 4
    xb, wb, bb, dyb = (t.bfloat16().float() for t in (x, w, b, dy))
    scales = (_current(xb, 448.0), _current(wb, 448.0), _current(dyb, MAX[E5M2]))
    for g, e in zip(got, _emulate(xb, wb, bb, dyb, scales, E5M2)):
        assert _rel(g, e) < 1e-2  # bf16 rounding of the results only


def test_quantize_saturates_instead_of_overflowing():
    t = torch.tensor([1e6, -float("inf"), float("inf"), 3.0, -1e9])
    assert quantize(t, torch.tensor(1.0), E4M3).float().tolist() == [448.0, -448.0, 448.0, 3.0, -448.0]
    assert quantize(t, torch.tensor(1.0), E5M2).float().tolist() == [57344.0, -57344.0, 57344.0, 3.0, -57344.0]


def test_saturated_operands_stay_finite():
    """Delayed scaling starts at scale 1: values past the FP8 range are clamped, never inf/NaN."""
    gemm = Fp8Gemm(Fp8Recipe(format="hybrid"))
    x, w, b, dy = _inputs()
    x[0, 0, 0], dy[0, 0, 0] = 1e5, 1e7
    got = _run(gemm, x, w, b, dy)
    assert all(torch.isfinite(t).all() for t in got)
    want = _emulate(x, w, b, dy, (torch.tensor(1.0),) * 3, E5M2)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6 * e.abs().max().item())
    # the clamp really happened: x[0,0,0] entered as 448, not 1e5
    assert got[0][0, 0].sub(F.linear(x[0, 0], w, b)).abs().max() > 1.0


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_zero_tensors(recipe):
    gemm = Fp8Gemm(Fp8Recipe(recipe=recipe))
    x, w, b, dy = _inputs()
    y, dx, dw, db = _run(gemm, torch.zeros_like(x), w, b, torch.zeros_like(dy))
    assert torch.equal(y, b.expand_as(y)) and not dx.any() and not dw.any() and not db.any()
    update_fp8_scales(gemm)
    # delayed: a zero amax carries no information, the old scale (1) is kept, never inf
    assert torch.equal(gemm.scale[[0, 2]], torch.ones(2))


def _reference_update(hist, scale, fp8_max, algo, margin):
    """One delayed-scaling update in plain Python floats (the recipe formula, step by step)."""
    new_scale = []
    for j in range(3):
        column = [row[j] for row in hist]
        a = column[0] if algo == "most_recent" else max(column)
        new_scale.append((fp8_max[j] / a) / 2**margin if a > 0 else scale[j])
    rolled = [[0.0, 0.0, 0.0]] + hist[2:] + [hist[0]] if len(hist) > 1 else [[0.0, 0.0, 0.0]]
    return rolled, new_scale


def _with_amax(t, a):
    return t / t.abs().max() * a


@pytest.mark.parametrize("algo", ["most_recent", "max"])
@pytest.mark.parametrize("length,margin", [(1, 0), (4, 0), (3, 2)])
def test_delayed_scaling_arithmetic_matches_step_by_step_reference(algo, length, margin):
    recipe = Fp8Recipe(format="hybrid", amax_history_len=length, amax_compute_algo=algo, margin=margin)
    gemm = Fp8Gemm(recipe)
    fp8_max = [448.0, 448.0, 57344.0]
    hist, scale = [[0.0, 0.0, 0.0] for _ in range(length)], [1.0, 1.0, 1.0]
    x0, w0, b, dy0 = _inputs()
    # per step, two micro-batches of (input amax, output-gradient amax); the weight amax moves slowly
    steps = [((2.0, 1e-3), (3.0, 4e-3)), ((0.5, 2e-2), (0.25, 1e-2)), ((0.0, 0.0), (0.0, 0.0)),
             ((8.0, 5e-4), (1.0, 1e-4)), ((1.5, 3e-3), (1.0, 1e-3))]
    for step, micro in enumerate(steps):
        w = _with_amax(w0, 0.1 + 0.01 * step)
        torch.testing.assert_close(gemm.scale, torch.tensor(scale), rtol=1e-6, atol=0)
        used = gemm.scale.clone()
        for ax, ag in micro:
            x, dy = _with_amax(x0, ax), _with_amax(dy0, ag)
            got = _run(gemm, x, w, b, dy)
            want = _emulate(x, w, b, dy, used, E5M2)  # this step uses the scales of the previous update
            for g, e in zip(got, want):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6 * e.abs().max().item() + 1e-30)
        hist[0] = [max(m[0] for m in micro), 0.1 + 0.01 * step, max(m[1] for m in micro)]
        torch.testing.assert_close(gemm.amax_history[0], torch.tensor(hist[0]), rtol=1e-6, atol=0)
        update_fp8_scales([gemm])
        hist, scale = _reference_update(hist, scale, fp8_max, algo, margin)
        torch.testing.assert_close(gemm.amax_history, torch.tensor(hist), rtol=1e-6, atol=0)
    torch.testing.assert_close(gemm.scale, torch.tensor(scale), rtol=1e-6, atol=0)


def test_roll_amax_history_table():
    old = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert roll_amax_history(old).flatten().tolist() == [0.0, 3.0, 4.0, 1.0]
    assert roll_amax_history(old[:2]).flatten().tolist() == [0.0, 1.0]
    assert roll_amax_history(old[:1]).flatten().tolist() == [0.0]


def test_tensorwise_keeps_no_state():
    gemm = Fp8Gemm(Fp8Recipe(recipe="tensorwise", amax_history_len=2))
    _run(gemm, *_inputs())
    assert update_fp8_scales(gemm) == 0
    assert not gemm.amax_history.any() and torch.equal(gemm.scale, torch.ones(3))


def test_unaligned_shape_falls_back_with_reason(scaled_mm_on_cpu):
    gemm = Fp8Gemm(Fp8Recipe(recipe="tensorwise"))
    x, w, b = _rand((5, 24), 1), _rand((16, 24), 2, 0.05), _rand(16, 3)
    with pytest.warns(UserWarning, match="inner dimension 24 is not divisible by 16"):
        y = gemm(x, w, b)
    assert gemm.fallbacks["fprop"] == "inner dimension 24 is not divisible by 16"
    want = _q(x, _current(x, 448.0), E4M3) @ _q(w, _current(w, 448.0), E4M3).t() + b
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_scaled_mm_blocker_reasons():
    a = torch.zeros(32, 32, dtype=E4M3)
    assert scaled_mm_blocker(a, a.t()) is None
    assert scaled_mm_blocker(a, a) == "second operand is not column-major"
    assert scaled_mm_blocker(a.t(), a.t()) == "first operand is not row-major"
    e5 = a.to(E5M2)
    assert scaled_mm_blocker(e5, e5.t()) == "E5M2 x E5M2 has no FP8 GEMM"
    assert scaled_mm_blocker(a, a[:8, :].t()) == "output dimension 8 is not divisible by 16"


def test_scaled_mm_equals_dequantised_matmul():
    a, b = _rand((32, 64), 5), _rand((48, 64), 6)
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    a8, b8 = quantize(a, 1 / sa, E4M3), quantize(b, 1 / sb, E4M3)
    out, reason = fp8_matmul(a8, b8.t(), sa, sb, torch.float32)
    assert reason is None
    torch.testing.assert_close(out, torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, (a8.float() * sa) @ (b8.float() * sb).t(), rtol=1e-6, atol=1e-6)


def test_state_is_checkpointed_and_resume_is_exact():
    recipe = Fp8Recipe(amax_history_len=3, amax_compute_algo="max")
    model = torch.nn.ModuleDict({"a": Fp8Gemm(recipe), "b": Fp8Gemm(recipe)})
    x, w, b, dy = _inputs()
    for step in range(2):
        for g in model.values():
            _run(g, x * (step + 1), w, b, dy)
        update_fp8_scales(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert set(state) == {"a.amax_history", "a.scale", "b.amax_history", "b.scale"}
    resumed = torch.nn.ModuleDict({"a": Fp8Gemm(recipe), "b": Fp8Gemm(recipe)})
    resumed.load_state_dict(state)
    assert len(fp8_gemms(resumed)) == 2
    for step in range(2):
        for name in model:
            for g, r in zip(_run(model[name], x * (3 - step), w, b, dy), _run(resumed[name], x * (3 - step), w, b, dy)):
                assert torch.equal(g, r)
        update_fp8_scales(model)
        update_fp8_scales(resumed)
    for k, v in model.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k])


def test_state_stays_fp32_when_model_is_cast():
    gemm = Fp8Gemm(Fp8Recipe()).to(torch.bfloat16)
    assert gemm.scale.dtype == gemm.amax_history.dtype == torch.float32


@pytest.mark.parametrize("kwargs,flag", [
    (dict(format="e5m2"), "--fp8-format"), (dict(recipe="nvfp4"), "--fp8-recipe"),
    (dict(amax_compute_algo="mean"), "--fp8-amax-compute-algo"), (dict(amax_history_len=0), "--fp8-amax-history-len"),
])
def test_recipe_validation(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        Fp8Recipe(**kwargs)


def test_evaluation_passes_leave_delayed_state_alone():
    gemm = Fp8Gemm(Fp8Recipe())
    x, w, b, _ = _inputs()
    with torch.no_grad():
        gemm(x, w, b)
    assert not gemm.amax_history.any()
    gemm(x, w, b)
    assert gemm.amax_history[0, 0] == x.abs().max() and gemm.amax_history[0, 1] == w.abs().max()


def _accumulating_steps(gemm, w, micro_batches=3, steps=2):
    """A training loop's use of one FP8 linear: per step, forward + backward of several micro-batches
    (the weight gradient accumulates), the scale update, then an in-place SGD update of the weight.
    Returns every output, input gradient, weight gradient, scale and amax history on the way."""
    w = w.clone().requires_grad_()
    seen = []
    for step in range(steps):
        for mb in range(micro_batches):
            x = _rand((S, B, K), 10 + 7 * step + mb).requires_grad_()
            y = gemm(x, w)
            y.backward(_rand((S, B, N), 50 + 7 * step + mb, 1e-3))
            seen += [y.detach(), x.grad]
        update_fp8_scales(gemm)
        seen += [w.grad.clone(), gemm.scale.clone(), gemm.amax_history.clone()]
        with torch.no_grad():
            w -= 0.5 * w.grad
        w.grad = None
    return seen


@pytest.mark.parametrize("path", ["device", "scaled_mm"])
def test_delayed_scaling_quantises_the_weight_once_per_step(path, monkeypatch, request):
    """With delayed scaling the weight and its scale are fixed within a step: the first micro-batch
    quantises the weight and the others reuse it, giving exactly the numbers of quantising every time."""
    if path == "scaled_mm":
        request.getfixturevalue("scaled_mm_on_cpu")
    weight_casts = []
    real = fp8.quantize

    def counting(t, scale, dtype, t_amax=None):
        weight_casts.extend([1] if t.shape == (N, K) else [])
        return real(t, scale, dtype, t_amax)

    monkeypatch.setattr(fp8, "quantize", counting)
    w = _rand((N, K), 2, 0.05)
    cached = _accumulating_steps(Fp8Gemm(Fp8Recipe()), w)
    assert len(weight_casts) == 2  # once in each of the 2 steps of 3 micro-batches
    monkeypatch.setattr(Fp8Gemm, "_cached_weight", lambda self, weight: None)
    every_time = _accumulating_steps(Fp8Gemm(Fp8Recipe()), w)
    assert len(weight_casts) == 2 + 6
    for a, b in zip(cached, every_time, strict=True):
        assert torch.equal(a, b)


def test_a_changed_weight_or_scale_is_quantised_again_and_evaluation_caches_nothing():
    x, w = _rand((S, B, K), 1).requires_grad_(), _rand((N, K), 2, 0.05).requires_grad_()
    gemm = Fp8Gemm(Fp8Recipe())
    with torch.no_grad():
        gemm(x, w)
    assert gemm._weight_fp8 is None  # evaluation: no cache, no amax recorded
    gemm(x, w)
    assert gemm._weight_fp8 is not None
    with torch.no_grad():
        w.mul_(2.0)  # same storage, new contents
    state = {k: v.clone() for k, v in gemm.state_dict().items()}

    def fresh(x, w):  # a gemm with the same state that has never seen the weight
        new = Fp8Gemm(Fp8Recipe())
        new.load_state_dict(state)
        return new(x, w)

    assert torch.equal(gemm(x, w), fresh(x, w))
    state["scale"] = torch.tensor([1.0, 3.0, 1.0])  # not a power of 2: another rounding of the weight
    gemm.load_state_dict(state)
    assert torch.equal(gemm(x, w), fresh(x, w))


@pytest.mark.parametrize("margin", [-17, 17])
def test_the_widest_accepted_margins_keep_outputs_and_gradients_finite(margin):
    """--fp8-margin is refused beyond +-17 (a margin of 130 made every scale 0 and the outputs NaN)."""
    gemm = Fp8Gemm(Fp8Recipe(format="hybrid", margin=margin))
    x, w, b, dy = _inputs()
    for _ in range(2):
        got = _run(gemm, x, w, b, dy)
        update_fp8_scales([gemm])
    assert all(torch.isfinite(t).all() for t in got) and (gemm.scale > 0).all()
