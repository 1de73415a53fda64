"""The dispatch mode of ``benchmarks/bench_bf16_projection.py``: 16-bit GEMMs computed as fp32 GEMMs
(the same results up to bf16's one rounding of the fp32 product), in place where the operator writes
in place, and every GEMM's FLOPs counted, 16-bit or not."""

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from benchmarks.bench_bf16_projection import (
    GemmsAsFp32,
    format_paired,
    format_projection,
    format_top_operators,
    gemm_flops,
    measure_runs,
)


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_16bit_gemms_become_fp32_gemms_and_every_gemm_is_counted():
    a, b, bias = _bf16(8, 16), _bf16(16, 4, seed=1), _bf16(4, seed=2)
    x, y = _bf16(3, 8, 16, seed=3), _bf16(3, 16, 5, seed=4)
    acc = _bf16(16, 4, seed=5)
    expected_acc = (acc.float() + a.float().t() @ _bf16(8, 4, seed=6).float()).bfloat16()
    with GemmsAsFp32() as mode:
        mm, addmm, bmm = a @ b, torch.addmm(bias, a, b), torch.bmm(x, y)
        acc.addmm_(a.t(), _bf16(8, 4, seed=6))
        fp32 = a.float() @ b.float()  # an fp32 GEMM: run as it is, still counted
    assert mm.dtype == addmm.dtype == bmm.dtype == acc.dtype == torch.bfloat16
    assert torch.equal(mm, (a.float() @ b.float()).bfloat16())
    assert torch.equal(addmm, torch.addmm(bias.float(), a.float(), b.float()).bfloat16())
    assert torch.equal(bmm, torch.bmm(x.float(), y.float()).bfloat16())
    assert torch.equal(acc, expected_acc)
    assert torch.equal(fp32, a.float() @ b.float())
    assert mode.flops == 2 * 8 * 16 * 4 * 3 + 2 * 3 * 8 * 16 * 5 + 2 * 16 * 8 * 4


def test_flops_of_non_gemms_are_zero():
    t = torch.ones(4, 4)
    assert gemm_flops(torch.ops.aten.add.Tensor, (t, t)) == 0
    assert gemm_flops(torch.ops.aten.mm.default, (t, torch.ones(4, 7))) == 2 * 4 * 4 * 7


def test_timed_mode_puts_each_operator_in_its_category():
    """GEMMs as GEMM, pointwise math as elementwise, copies as copies, and everything inside a
    torch.optim step as optimizer (the global step hooks), whatever the operator."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = torch.optim.SGD([w], lr=0.1)
    with GemmsAsFp32(timed=True) as mode:
        y = (w @ w).relu()
        y.bfloat16()
        w.grad = torch.ones_like(w)
        opt.step()
    assert mode.calls >= 5 and all(v >= 0 for v in mode.seconds.values())
    assert mode.seconds["GEMM"] > 0 and mode.seconds["elementwise"] > 0 and mode.seconds["copies"] > 0
    assert mode.seconds["optimizer"] > 0 and not mode.in_optimizer
    assert "mm float32 (GEMM)" not in mode.by_operator  # --top lists what is left besides the GEMMs
    assert mode.by_operator["relu float32 (elementwise)"][1] == 1
    assert any(name.endswith("(optimizer)") for name in mode.by_operator)
    listed = format_top_operators(mode, steps=1, top=2).splitlines()
    assert len(listed) == 3 and listed[0].startswith("  top 2 operators")
    seen = []  # the mode's step hooks went with it: a later step leaves it alone
    probe = register_optimizer_step_pre_hook(lambda *_: seen.append(mode.in_optimizer))
    try:
        opt.step()
    finally:
        probe.remove()
    assert seen == [False]


def test_runs_alternate_and_each_reports_its_median_step():
    w = torch.randn(16, 16).bfloat16().requires_grad_()
    order = []

    def step(name, rows):
        def run():
            order.append(name)
            (_bf16(rows, 16, seed=7) @ w).float().sum().backward()  # two bf16 GEMMs: x w and x^T dy
        return run

    results = measure_runs({"a": step("a", 4), "b": step("b", 8)}, steps=3, warmup=1, per_call=0.0)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-ups, then rounds in alternating order
    for name, rows in (("a", 4), ("b", 8)):
        (rest, totals, _, flops, _), every, mode = results[name]
        assert len(every) == 3 and flops == 2 * (2 * rows * 16 * 16)  # per step, not summed over the steps
        assert rest == sum(v for k, v in totals.items() if k != "GEMM") == sorted(r for r, _ in every)[1]
        assert len(mode._scratch) == 6  # per GEMM: 2 widened operands and the product, reused step after step


def test_each_run_is_projected_to_its_own_dtypes_peak_and_compared_with_hf_of_that_dtype():
    peaks = {"ours-fp32": 0.4e12, "hf-fp32": 0.4e12, "ours-bf16": 2e12, "hf-bf16": 2e12, "ours-fp8": 2e12}
    rows = {"ours-fp32": (4e11, 0.5, 1.5), "hf-fp32": (4e11, 1.0, 3.0), "ours-bf16": (4e11, 0.3, 0.5),
            "hf-bf16": (4e11, 1.8, 2.0), "ours-fp8": (4e11, 0.4, 0.6)}
    table = format_projection(rows, peaks, flops_per_step=4e11).splitlines()
    cells = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table if line.startswith("| ours")}
    assert cells["ours-fp32"][4:] == ["67%", "2.00x |"]  # 4e11 / 0.4e12 / 1.5 s; HF fp32 3.0 s / 1.5 s
    assert cells["ours-bf16"][4:] == ["40%", "4.00x |"]  # 4e11 / 2e12 / 0.5 s; HF bf16 2.0 s / 0.5 s
    assert cells["ours-fp8"][4:] == ["33%", "3.33x |"]  # against HF bf16
    assert "FP8 step / bf16 step, projected: 1.20x" in table[-1]
    paired = format_paired({"hf-fp32": [3.0, 2.0, 4.0], "ours-fp32": [1.5, 2.0, 1.0], "ours-bf16": [1.0]}).splitlines()
    assert paired == ["HF fp32 / ours fp32, projected, round by round: 2.00, 1.00, 4.00 (median 2.00x)"]
