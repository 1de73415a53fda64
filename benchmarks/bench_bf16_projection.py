"""The bf16 and FP8 steps of ``bench_step.py`` on a CPU without bf16 matrix units: everything but the
GEMMs measured, and the step projected for a CPU that has them.

Without bf16 units a bf16 GEMM is emulated (~1 GFLOP/s: one step of the issue's config takes about
12 minutes), so ``bench_step.py`` cannot judge the bf16 and FP8 targets on such a CPU. This runs the
same steps with every 16-bit GEMM computed as an fp32 GEMM under a ``TorchDispatchMode`` (inputs
widened, the product narrowed back), on the code paths a CPU with bf16 units takes (the CPU
attention's products in bf16, FP8's dequantised GEMMs widened to bf16). The same mode times every
other operator, by category, and the step's wall time less all operators is the framework's own
time (Python, autograd), less the mode's own cost per operator call (measured on a real step's
operators: our fp32 step at the ``quick`` shape with the mode and without, :func:`mode_seconds_per_call`):
the part of the step a faster GEMM does not shrink. The step is projected as

    projected step = (FLOPs of the step's GEMMs) / (bf16 GEMM peak) + (everything else, measured)

for a given peak (default 2.81 TFLOP/s: the issue's CPU at 2 threads), with model-FLOP utilisation
against that peak and the ratios between runs (Hugging Face GPT-2 with bf16 autocast included). The
fp32 runs (``ours-fp32``, ``hf-fp32``; not in the default list) are projected the same way to that
CPU's fp32 peak (``--fp32-peak-tflops``, default 0.40): on a CPU whose fp32 GEMMs are slower than
the target's, the GEMMs dominate both steps and the measured ratio understates what a cheaper
rest is worth there. The
GEMM term is a lower bound (no GEMM runs at its peak), and the rest is measured on this CPU, whose
elementwise speed is not the target's: the non-GEMM seconds are measurements, the projection an
estimate: 16-bit elementwise work (the attention's softmax and masks among it) runs slower on a CPU
without bf16 instructions than on one with them, so the default (attention in bf16, as there)
over-counts it; ``--fp32-attention`` keeps this CPU's fp32 attention (its casts then count, its
products as GEMMs), which under-counts it. The two bracket the target.

Why not torch.profiler: its own allocations during the step split glibc's freed large blocks, so the
step's large tensors (the logits) land on fresh pages every step (60-170 thousand minor page faults
per profiled step against 0-20 thousand without, measured), and the operators that first touch
them (the loss's softmax, a cast) then looked 5-10x slower than they are. For the same reason the
stand-in GEMMs reuse their fp32 buffers from step to step, and the step reported is the median of
``--steps`` by its non-GEMM time (a step that still faulted does not move it); every step's time and
minor page faults are printed. After their warm-up the runs take turns, one step each, the order
alternating every round, so a drift of the host's speed (20-40% within minutes on shared machines)
reaches every run alike.

    python benchmarks/bench_bf16_projection.py [--shape issue|quick] [--runs ours-bf16 ours-fp8 hf-bf16]
                                               [--peak-tflops 2.81] [--steps 3] [--fp32-attention] [--top N]
    python benchmarks/bench_bf16_projection.py --runs ours-fp32 hf-fp32 [--fp32-peak-tflops 0.40]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.bench_step import FLAGS, SHAPES, build_hf, build_ours, model_flops  # noqa: E402
from benchmarks.common import OneLineParser, describe_machine, positive_float, positive_int, probability  # noqa: E402
from megatron_lite.perf.host_memory import minor_page_faults  # noqa: E402
from megatron_lite.perf.op_categories import CATEGORIES, category_of_name, format_breakdown  # noqa: E402

aten = torch.ops.aten
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


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


OUT_VARIANTS = {aten.mm.default: aten.mm.out, aten.addmm.default: aten.addmm.out, aten.bmm.default: aten.bmm.out,
                aten.baddbmm.default: aten.baddbmm.out}


class GemmsAsFp32(TorchDispatchMode):
    """Counts the FLOPs of every GEMM and computes the 16-bit ones as fp32 GEMMs, narrowed back (in
    place for ``addmm_``/``baddbmm_``, into ``out=``). With ``timed``, also the seconds spent in
    operators per category (a GEMM with its widening and narrowing counts as GEMM) and the calls."""

    def __init__(self, timed: bool = False, scratch: dict | None = None):
        super().__init__()
        self.flops, self.timed, self.calls = 0, timed, 0
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.by_operator: dict[str, list] = {}  # "name dtype (category)" -> [seconds, calls], GEMMs left out
        self.in_optimizer = False  # set by torch.optim's global step hooks while timed
        self._category = {}  # operator -> category by its name
        self._scratch = {} if scratch is None else scratch  # (role, shape, strides) -> fp32 buffer, reused

    def __enter__(self):
        if self.timed:
            self._hooks = (register_optimizer_step_pre_hook(lambda *_: setattr(self, "in_optimizer", True)),
                           register_optimizer_step_post_hook(lambda *_: setattr(self, "in_optimizer", False)))
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in getattr(self, "_hooks", ()):
            hook.remove()
        return super().__exit__(*exc)

    def category(self, func, flops: int) -> str:
        if flops:
            return "GEMM"
        if self.in_optimizer:
            return "optimizer"
        if func not in self._category:
            self._category[func] = category_of_name(f"aten::{func.overloadpacket.__name__}") or "other"
        return self._category[func]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flops = gemm_flops(func, args)
        self.flops += flops
        if not self.timed:
            return self._run(func, args, kwargs, flops)
        start = time.perf_counter()
        result = self._run(func, args, kwargs, flops)
        seconds, category = time.perf_counter() - start, self.category(func, flops)
        self.seconds[category] += seconds
        self.calls += 1
        if category != "GEMM":
            dtype = next((str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)), "")
            entry = self.by_operator.setdefault(f"{func.overloadpacket.__name__} {dtype} ({category})", [0.0, 0])
            entry[0] += seconds
            entry[1] += 1
        return result

    def _buffer(self, role, shape, strides=None) -> torch.Tensor:
        """An fp32 buffer of ``shape`` (with ``strides`` when given), kept for the next step: fresh fp32
        copies of every operand and product each step would fragment glibc's heap (the real step makes
        none), and the step's own large tensors would then fault in fresh pages."""
        key = (role, tuple(shape), strides)
        if key not in self._scratch:
            self._scratch[key] = (torch.empty(shape, dtype=torch.float32) if strides is None
                                  else torch.empty_strided(shape, strides, dtype=torch.float32))
        return self._scratch[key]

    def _widened(self, value, role):
        """A 16-bit operand copied into an fp32 buffer laid out as it is (plain or transposed), else as is."""
        if not (isinstance(value, torch.Tensor) and value.dtype in SIXTEEN_BIT):
            return value
        plain = value.is_contiguous() or (value.dim() >= 2 and value.mT.is_contiguous())
        return self._buffer(role, value.shape, tuple(value.stride()) if plain else None).copy_(value)

    def _run(self, func, args, kwargs, flops):
        if not flops or not any(isinstance(a, torch.Tensor) and a.dtype in SIXTEEN_BIT for a in args):
            return func(*args, **kwargs)
        out = kwargs.pop("out", None)
        if func in (aten.addmm_.default, aten.baddbmm_.default):
            out = args[0]
        plain = {aten.addmm_.default: aten.addmm.default, aten.baddbmm_.default: aten.baddbmm.default}.get(
            func, func.overloadpacket.default)
        wide = [self._widened(a, i) for i, a in enumerate(args)]
        a, b = wide[-2], wide[-1]  # the two factors come last (after the addend, if any)
        result = OUT_VARIANTS[plain](*wide, **kwargs, out=self._buffer("product", (*a.shape[:-1], b.shape[-1])))
        if out is not None:
            return out.copy_(result)
        return result.to(args[0].dtype if func in (aten.mm.default, aten.bmm.default) else args[1].dtype)


def tiny_add_seconds_per_call(calls: int = 4000) -> float:
    """What the timed mode adds to a tiny ``add`` called in a tight loop (with the mode and without)."""
    a = torch.ones(4)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            torch.add(a, a)
        return time.perf_counter() - start

    loop()
    bare = min(loop() for _ in range(3))
    with GemmsAsFp32(timed=True):
        loop()
        moded = min(loop() for _ in range(3))
    return max(0.0, (moded - bare) / calls)


def mode_seconds_per_call(dropout: float, rounds: int = 21) -> float:
    """What the timed mode adds to one operator call of a real step: our fp32 step at the ``quick`` shape
    (its GEMMs need no stand-in, so the mode only times them), with the mode and without, alternating;
    the median of the rounds' differences over the step's operator calls. A tiny ``add`` in a tight loop
    (:func:`tiny_add_seconds_per_call`) measured about half of that here: a real step's operators run
    between the mode's own Python, not after a warm copy of themselves."""
    step = RUNS["ours-fp32"](SHAPES["quick"], dropout)
    mode = GemmsAsFp32(timed=True)
    for _ in range(3):
        step()
        with mode:
            step()
    differences = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        bare = time.perf_counter() - start
        calls, start = mode.calls, time.perf_counter()
        with mode:
            step()
        differences.append((time.perf_counter() - start - bare) / (mode.calls - calls))
    return max(0.0, statistics.median(differences))


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
    "ours-fp32": lambda shape, dropout: build_ours(shape, dropout, FLAGS["fp32"])[0],
    "hf-fp32": lambda shape, dropout: build_hf(shape, dropout, bf16=False),
}
FP32_RUNS = ("ours-fp32", "hf-fp32")  # projected to the fp32 GEMM peak; the others to the bf16 one
HF_OF = {"ours-bf16": "hf-bf16", "ours-fp8": "hf-bf16", "ours-fp32": "hf-fp32"}  # the run each is compared with
PAIRS = (("hf-bf16", "ours-bf16", "HF bf16 / ours bf16"), ("hf-bf16", "ours-fp8", "HF bf16 / ours FP8"),
         ("ours-fp8", "ours-bf16", "FP8 / bf16"), ("hf-fp32", "ours-fp32", "HF fp32 / ours fp32"))


def measure_step(step, mode: GemmsAsFp32, per_call: float) -> tuple[float, dict[str, float], float, int, int]:
    """One step in the timed ``mode``: (non-GEMM seconds, seconds per category ("other": the framework's
    own time, the mode's cost taken out), the mode's cost taken out, GEMM FLOPs, minor page faults)."""
    with mode:
        seconds, calls, flops = dict(mode.seconds), mode.calls, mode.flops
        faults, start = minor_page_faults(), time.perf_counter()
        step()
        wall, faults = time.perf_counter() - start, minor_page_faults() - faults
    totals = {k: v - seconds[k] for k, v in mode.seconds.items()}
    own = (mode.calls - calls) * per_call
    totals["other"] += max(0.0, wall - sum(totals.values()) - own)
    return sum(v for k, v in totals.items() if k != "GEMM"), totals, own, mode.flops - flops, faults


def measure_runs(runs: dict, steps: int, warmup: int, per_call: float) -> dict:
    """Each run's ``warmup`` steps, then ``steps`` rounds of one measured step per run, the order
    alternating (the host's speed drifts over minutes: each run sees the same drift). Per run: the
    median step by its non-GEMM seconds (a step that still faulted in fresh pages does not move it,
    :func:`measure_step`'s tuple), every step's (non-GEMM seconds, faults), and its timed mode (its
    operators over all measured steps)."""
    modes = {}
    for name, step in runs.items():
        with GemmsAsFp32() as warm:
            for _ in range(warmup):
                step()
        modes[name] = GemmsAsFp32(timed=True, scratch=warm._scratch)
    measured = {name: [] for name in runs}
    for r in range(steps):
        for name in list(runs) if r % 2 == 0 else reversed(list(runs)):
            measured[name].append(measure_step(runs[name], modes[name], per_call))
    return {name: (sorted(m, key=lambda x: x[0])[(len(m) - 1) // 2], [(x[0], x[4]) for x in m], modes[name])
            for name, m in measured.items()}


def format_top_operators(mode: GemmsAsFp32, steps: int, top: int) -> str:
    """The ``top`` operators outside the GEMMs by time per step, with their calls per step."""
    rows = sorted(mode.by_operator.items(), key=lambda kv: -kv[1][0])[:top]
    lines = [f"  top {len(rows)} operators outside the GEMMs (ms per step, calls per step):"]
    lines += [f"  {seconds / steps * 1e3:9.1f} {calls / steps:7.0f}  {name}" for name, (seconds, calls) in rows]
    return "\n".join(lines)


def format_projection(rows: dict, peaks: dict, flops_per_step: float) -> str:
    """The projected table: per run (``rows``: name -> (GEMM FLOPs, rest seconds, projected seconds)) its
    MFU against its own dtype's peak and its speed against the Hugging Face run of its dtype (FP8: bf16)."""
    lines = ["| run | GEMM GFLOP per step | everything else (measured) | projected step | MFU vs its dtype's peak "
             "| vs HF (FP8: HF bf16) |", "|---|---|---|---|---|---|"]
    for name, (flops, rest, step) in rows.items():
        hf = rows.get(HF_OF.get(name), (0, 0, None))[2]
        vs = f"{hf / step:.2f}x" if hf else "-"
        lines.append(f"| {name} | {flops / 1e9:.0f} | {rest:.3f} s | {step:.3f} s | "
                     f"{flops_per_step / peaks[name] / step:.0%} | {vs} |")
    if "ours-fp8" in rows and "ours-bf16" in rows:
        lines.append(f"\nFP8 step / bf16 step, projected: {rows['ours-fp8'][2] / rows['ours-bf16'][2]:.2f}x "
                     "(target: within 1.3x)")
    return "\n".join(lines)


def format_paired(rounds: dict) -> str:
    """Ratios of projected steps round by round (the runs alternated), with their median."""
    lines = []
    for slower, faster, what in PAIRS:
        if slower in rounds and faster in rounds:
            paired = [a / b for a, b in zip(rounds[slower], rounds[faster])]
            lines.append(f"{what}, projected, round by round: " + ", ".join(f"{r:.2f}" for r in paired)
                         + f" (median {statistics.median(paired):.2f}x)")
    return "\n".join(lines)


def parse(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["issue", "quick"], default="issue")
    p.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=["ours-bf16", "ours-fp8", "hf-bf16"])
    p.add_argument("--peak-tflops", type=positive_float, default=2.81, help="bf16 GEMM peak of the CPU projected to")
    p.add_argument("--fp32-peak-tflops", type=positive_float, default=0.40,
                   help="fp32 GEMM peak of the CPU projected to (the fp32 runs: ours-fp32, hf-fp32)")
    p.add_argument("--steps", type=positive_int, default=3, help="measured steps per run (after --warmup); the median counts")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps first: until glibc's retained heap stops growing, a step faults in fresh pages")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--top", type=int, default=0, help="also list this many operators outside the GEMMs by time")
    p.add_argument("--dropout", type=probability, default=0.1)
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
    flops_per_step = model_flops(shape)
    peaks = {name: (args.fp32_peak_tflops if name in FP32_RUNS else args.peak_tflops) * 1e12 for name in args.runs}
    per_call, tiny = mode_seconds_per_call(args.dropout), tiny_add_seconds_per_call()
    print(f"the timed mode's own cost per operator call, taken out of every step: {per_call * 1e6:.1f} us (measured "
          f"on our fp32 step at the quick shape; a tiny add in a tight loop: {tiny * 1e6:.1f} us)")
    results = measure_runs({name: RUNS[name](shape, args.dropout) for name in args.runs}, args.steps, args.warmup,
                           per_call)
    rows, rounds = {}, {}
    for name, ((rest, totals, own, flops, faults), every, mode) in results.items():
        rows[name] = (flops, rest, flops / peaks[name] + rest)
        rounds[name] = [flops / peaks[name] + rest_s for rest_s, _ in every]  # projected step of each round
        print("\n" + format_breakdown(totals, f"{name}: the median of {args.steps} steps, seconds (GEMM: its fp32 "
                                      "stand-in; other: Python, autograd)"))
        print(f"  (the dispatch mode's own cost, left out: {own:.3f} s per step, {per_call * 1e6:.1f} us per "
              f"operator call; minor page faults in this step: {faults})")
        print("  every step, non-GEMM seconds (minor page faults): "
              + ", ".join(f"{rest_s:.3f} ({n})" for rest_s, n in every))
        if args.top:
            print(format_top_operators(mode, args.steps, args.top))
    print(f"\nprojected to GEMM peaks of {args.peak_tflops:.2f} TFLOP/s in bf16 and {args.fp32_peak_tflops:.2f} in "
          f"fp32; model FLOPs per step {flops_per_step / 1e9:.1f} GFLOP")
    print(format_projection(rows, peaks, flops_per_step))
    print(format_paired(rounds))
    print("targets (issue 21): ours bf16 >= 2.0x HF bf16 autocast and >= 40% MFU; FP8 within 1.3x of bf16; "
          "ours fp32 >= 1.25x HF fp32")


if __name__ == "__main__":
    main()
