"""The bf16 and FP8 steps of ``bench_step.py`` on a CPU without bf16 matrix units: everything but the
GEMMs measured, and the step projected for a CPU that has them.

Without bf16 units a bf16 GEMM is emulated (~1 GFLOP/s: one step of the issue's config takes about
12 minutes), so ``bench_step.py`` cannot judge the bf16 and FP8 targets on such a CPU. This runs the
same steps with every 16-bit GEMM computed as an fp32 GEMM under a ``TorchDispatchMode`` (inputs
widened, the product narrowed back), on the code paths a CPU with bf16 units takes (the CPU
attention's products in bf16, FP8's dequantised GEMMs widened to bf16). torch.profiler then times
everything else, by category: the part of the step a faster GEMM does not shrink. The step is
projected as

    projected step = (FLOPs of the step's GEMMs) / (bf16 GEMM peak) + (everything else, measured)

for a given peak (default 2.81 TFLOP/s: the issue's CPU at 2 threads), with model-FLOP utilisation
against that peak and the ratios between runs (Hugging Face GPT-2 with bf16 autocast included). The
GEMM term is a lower bound (no GEMM runs at its peak), and the rest is measured on this CPU, whose
elementwise speed is not the target's: the non-GEMM seconds are measurements, the projection an
estimate: 16-bit elementwise work (the attention's softmax and masks among it) runs slower on a CPU
without bf16 instructions than on one with them, so the default (attention in bf16, as there)
over-counts it; ``--fp32-attention`` keeps this CPU's fp32 attention (its casts then count, its
products as GEMMs), which under-counts it. The two bracket the target. The dispatch mode's own
Python time is left out (reported on its own line).

    python benchmarks/bench_bf16_projection.py [--shape issue|quick] [--runs ours-bf16 ours-fp8 hf-bf16]
                                               [--peak-tflops 2.81] [--steps 2] [--fp32-attention]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.bench_step import FLAGS, SHAPES, build_hf, build_ours, model_flops  # noqa: E402
from benchmarks.common import describe_machine  # noqa: E402
from megatron_lite.perf.op_categories import CATEGORIES, category_of, format_breakdown  # noqa: E402

aten = torch.ops.aten
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
GEMM_TAG = "gemm_as_fp32"
MODE_EVENT = "PythonDispatchMode"  # the profiler's event for the mode's own Python time


def gemm_flops(func, args) -> int:
    """2 M N K (times the batch) of a GEMM operator call; 0 for anything else."""
    if func in (aten.mm.default, aten.mm.out):
        (m, k), n = args[0].shape, args[1].shape[-1]
        return 2 * m * n * k
    if func in (aten.addmm.default, aten.addmm_.default, aten.addmm.out):
        (m, k), n = args[1].shape, args[2].shape[-1]
        return 2 * m * n * k
    if func in (aten.bmm.default, aten.bmm.out):
        (b, m, k), n = args[0].shape, args[1].shape[-1]
        return 2 * b * m * n * k
    if func in (aten.baddbmm.default, aten.baddbmm_.default, aten.baddbmm.out):
        (b, m, k), n = args[1].shape, args[2].shape[-1]
        return 2 * b * m * n * k
    return 0


def _widened(value):
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in SIXTEEN_BIT else value


class GemmsAsFp32(TorchDispatchMode):
    """Counts the FLOPs of every GEMM and computes the 16-bit ones as fp32 GEMMs, narrowed back (in
    place for ``addmm_``/``baddbmm_``, into ``out=``), inside a ``gemm_as_fp32`` profiler range."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flops = gemm_flops(func, args)
        self.flops += flops
        if not flops or not any(isinstance(a, torch.Tensor) and a.dtype in SIXTEEN_BIT for a in args):
            return func(*args, **kwargs)
        with record_function(GEMM_TAG):
            out = kwargs.pop("out", None)
            if func in (aten.addmm_.default, aten.baddbmm_.default):
                out = args[0]
            plain = {aten.addmm_.default: aten.addmm.default, aten.baddbmm_.default: aten.baddbmm.default}.get(
                func, func.overloadpacket.default)
            result = plain(*[_widened(a) for a in args], **kwargs)
            if out is not None:
                return out.copy_(result)
            return result.to(args[0].dtype if func in (aten.mm.default, aten.bmm.default) else args[1].dtype)


def _inside(event, name: str) -> bool:
    parent = event
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def non_gemm_seconds(events, steps: int) -> tuple[dict[str, float], float]:
    """Self CPU seconds per category per step (GEMMs and their widening counted as GEMM), and the
    dispatch mode's own seconds per step."""
    totals, mode = dict.fromkeys(CATEGORIES, 0.0), 0.0
    for event in events:
        us = event.self_cpu_time_total
        if not us:
            continue
        if event.name == MODE_EVENT:
            mode += us / 1e6
        else:
            totals["GEMM" if _inside(event, GEMM_TAG) else category_of(event)] += us / 1e6
    return {k: v / steps for k, v in totals.items()}, mode / steps


def bf16_cpu_paths(fp32_attention: bool) -> None:
    """The code paths of a CPU with bf16 units: the CPU attention keeps bf16 (unless ``fp32_attention``),
    FP8 widens to bf16."""
    from megatron_lite.models import cpu_attention
    from megatron_lite.precision import fp8_ops

    if not fp32_attention:
        cpu_attention.compute_dtype = lambda dtype: dtype
    fp8_ops.cpu_gemm_dtype = lambda: torch.bfloat16


RUNS = {
    "ours-bf16": lambda shape, dropout: build_ours(shape, dropout, FLAGS["bf16"])[0],
    "ours-fp8": lambda shape, dropout: build_ours(shape, dropout, FLAGS["fp8"])[0],
    "hf-bf16": lambda shape, dropout: build_hf(shape, dropout, bf16=True),
}


def measure(step, steps: int, warmup: int) -> tuple[dict[str, float], float, int]:
    """(seconds per category per step, the mode's seconds per step, GEMM FLOPs per step)."""
    with GemmsAsFp32() as mode:
        for _ in range(warmup):
            step()
        mode.flops = 0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        totals, own = non_gemm_seconds(prof.events(), steps)
    return totals, own, mode.flops // steps


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["issue", "quick"], default="issue")
    p.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=["ours-bf16", "ours-fp8", "hf-bf16"])
    p.add_argument("--peak-tflops", type=float, default=2.81, help="bf16 GEMM peak of the CPU projected to")
    p.add_argument("--steps", type=int, default=2, help="profiled steps per run (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--fp32-attention", action="store_true",
                   help="the CPU attention in fp32, as on a CPU without bf16 units (its softmax and masks then run "
                   "at this CPU's fp32 pace, not its slow bf16 one; its casts count, its products as GEMMs)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    print(describe_machine(args.threads))
    print("config: " + ", ".join(f"{k} {v}" for k, v in shape.items()) + f", dropout {args.dropout}, AdamW")
    bf16_cpu_paths(args.fp32_attention)
    flops_per_step, peak = model_flops(shape), args.peak_tflops * 1e12
    rows = {}
    for name in args.runs:
        totals, own, flops = measure(RUNS[name](shape, args.dropout), args.steps, args.warmup)
        rest = sum(v for k, v in totals.items() if k != "GEMM")
        rows[name] = (flops, rest, flops / peak + rest)
        print("\n" + format_breakdown(totals, f"{name}: self CPU seconds per step (GEMM: its fp32 stand-in)"))
        print(f"  (the dispatch mode's own Python time, left out: {own:.3f} s per step)")
    print(f"\nprojected to a bf16 GEMM peak of {args.peak_tflops:.2f} TFLOP/s; model FLOPs per step "
          f"{flops_per_step / 1e9:.1f} GFLOP")
    print("| run | GEMM GFLOP per step | everything else (measured) | projected step | MFU | vs HF bf16 |\n"
          "|---|---|---|---|---|---|")
    hf = rows.get("hf-bf16", (0, 0, None))[2]
    for name, (flops, rest, step) in rows.items():
        vs = f"{hf / step:.2f}x" if hf and name != "hf-bf16" else "-"
        print(f"| {name} | {flops / 1e9:.0f} | {rest:.3f} s | {step:.3f} s | {flops_per_step / peak / step:.0%} | {vs} |")
    if "ours-fp8" in rows and "ours-bf16" in rows:
        print(f"\nFP8 step / bf16 step, projected: {rows['ours-fp8'][2] / rows['ours-bf16'][2]:.2f}x "
              "(target: within 1.3x)")
    print("targets (issue 21): ours bf16 >= 2.0x HF bf16 autocast and >= 40% MFU; FP8 within 1.3x of bf16")

if __name__ == "__main__":
    main()
