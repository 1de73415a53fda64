"""FP8 vs bf16 vs fp32: GEMM peaks, the linears' GEMMs and a GPT training step, in one run.

Runs on the GPU when one is visible (else the CPU) and prints the device and which FP8 GEMM path
runs there (``torch._scaled_mm`` on a GPU; on a CPU exact dequantised GEMMs in the faster of
fp32 and bf16, chosen by a one-time probe: see ``megatron_lite/precision/fp8_ops.py``):

* GEMM peaks: an ``n``-cubed fp32 and bf16 matmul (n = ``--hidden``), and on a CPU the emulated
  ``torch._scaled_mm`` at 256 cubed next to the dequantised GEMM that replaces it.
* GEMM only: the three GEMMs of a linear (forward ``X W^T``, dgrad ``dY W``, wgrad ``dY^T X``) for
  each linear shape of a transformer layer: fp32, bf16, and the FP8 linear (:class:`Fp8Gemm`
  forward + backward on bf16 tensors: amaxes, quantisation and the three FP8 GEMMs). TFLOP/s counts
  2*M*N*K per GEMM.
* Training step (forward, backward, AdamW) of the project's ``GPTModel``: fp32 params, bf16 params,
  and bf16 params with FP8 linears (QKV, projection, fc1, fc2; the delayed recipe's scale update
  once per step), once per ``--fp8-recipe`` given (several: side by side in the same run). Printed:
  median step times and FP8 / bf16, FP8 / fp32. The FP8 target is an FP8
  step within 1.3x of the bf16 step; it is judged where bf16 GEMMs run at least as fast as fp32
  ones (bf16 matrix units or tensor cores): the script says whether this device can judge it.

Shapes: the default is small enough for a CPU without fast bf16 (2 layers, hidden 256, 4 heads,
seq 128, batch 2, vocab 1024); ``--issue-config`` is the training-speed issue's model (6 layers,
hidden 768, 12 heads, seq 512, batch 4, vocab 32768).

    python benchmarks/bench_fp8.py [--issue-config] [--steps 3] [--fp8-format hybrid] [--fp8-recipe delayed]
    python benchmarks/bench_fp8.py --fp8-recipe delayed tensorwise blockwise mxfp8
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402
from megatron_lite.models import GPTModel, TransformerConfig  # noqa: E402
from megatron_lite.parallel.state import ParallelState  # noqa: E402
from megatron_lite.precision.fp8 import FP8_RECIPES, Fp8Gemm, Fp8Recipe, update_fp8_scales  # noqa: E402
from megatron_lite.precision.fp8_describe import describe_fp8_path  # noqa: E402
from megatron_lite.precision.fp8_ops import (  # noqa: E402,E501
    DEQUANTISED,
    E4M3,
    column_major,
    dequantised_matmul,
    fp8_gemm_path,
    quantize,
)

SMALL = dict(layers=2, hidden=256, heads=4, seq=128, batch=2, vocab=1024)
ISSUE = dict(layers=6, hidden=768, heads=12, seq=512, batch=4, vocab=32768)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device, steps, warmup=1) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_peaks(n: int, device, steps: int) -> dict[str, float]:
    """TFLOP/s of an n-cubed matmul per dtype."""
    out = {}
    for name, dtype in DTYPES.items():
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        out[name] = 2 * n**3 / _median_time(lambda a=a, b=b: a @ b, device, steps) / 1e12
    return out


def cpu_scaled_mm_probe(device) -> tuple[float, float]:
    """GFLOP/s of the emulated ``torch._scaled_mm`` and of the dequantised GEMM at 256 cubed (one call each)."""
    one, n = torch.ones((), device=device), 256
    a8 = quantize(torch.randn(n, n, device=device), one, E4M3)
    b8 = column_major(quantize(torch.randn(n, n, device=device), one, E4M3))
    kernel = _median_time(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                          device, 1, warmup=0)
    ours = _median_time(lambda: dequantised_matmul(a8, b8, one, one, torch.bfloat16), device, 3)
    return 2 * n**3 / kernel / 1e9, 2 * n**3 / ours / 1e9


def _gemm_shapes(c):
    """(name, M, K, N) of a transformer layer's linears: Y[M, N] = X[M, K] W[N, K]^T."""
    tokens, h = c["seq"] * c["batch"], c["hidden"]
    return [("qkv", tokens, h, 3 * h), ("proj", tokens, h, h), ("fc1", tokens, h, 4 * h), ("fc2", tokens, 4 * h, h)]


def _time_linear(m, k, n, recipes, device, steps) -> dict[str, float]:
    """Seconds for forward + dgrad + wgrad of one linear in fp32, bf16 and FP8 under each recipe
    (Fp8Gemm, bf16 tensors; keyed by the recipe's name)."""
    x, w, dy = (torch.randn(s, device=device) for s in ((m, k), (n, k), (m, n)))
    out = {}
    for name, dtype in DTYPES.items():
        xd, wd, dyd = x.to(dtype), w.to(dtype), dy.to(dtype)
        out[name] = _median_time(lambda x=xd, w=wd, dy=dyd: (x @ w.t(), dy @ w, dy.t() @ x), device, steps)
    xr, wr, dyb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_(), dy.bfloat16()
    for recipe in recipes:
        gemm = Fp8Gemm(recipe).to(device)
        out[recipe.recipe] = _median_time(lambda g=gemm: g(xr, wr).backward(dyb), device, steps)
    return out


def bench_gemms(c, recipes, device, steps) -> None:
    print("\n== GEMM only: forward + dgrad + wgrad of each linear, TFLOP/s (FP8: Fp8Gemm incl. quantisation, "
          "one column per recipe; x: its time over bf16's) ==")
    names = [r.recipe for r in recipes]
    print(f"{'gemm':6s} {'M x K x N':>18s} {'fp32':>8s} {'bf16':>8s} " + " ".join(f"{n:>18s}" for n in names))
    for name, m, k, n in _gemm_shapes(c):
        t = _time_linear(m, k, n, recipes, device, steps)
        flops = 3 * 2 * m * n * k
        tf = {key: flops / v / 1e12 for key, v in t.items()}
        cells = [f"{tf[r]:.3f} ({t[r] / t['bf16']:.2f}x)" for r in names]
        fp8 = " ".join(f"{cell:>18s}" for cell in cells)
        print(f"{name:6s} {f'{m}x{k}x{n}':>18s} {tf['fp32']:8.3f} {tf['bf16']:8.3f} {fp8}")


def _gpt_step(c, args, device, dtype, recipe: str | None) -> float:
    """Median seconds of one forward + backward + AdamW step of GPTModel (FP8 linears under ``recipe``)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
                            seq_length=c["seq"], vocab_size=c["vocab"], attention_dropout=0.0, hidden_dropout=0.0,
                            params_dtype=dtype, fp8=args.fp8_format if recipe else None, fp8_recipe=recipe or "delayed")
    model = GPTModel(cfg, ParallelState()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=gen).to(device) for _ in range(2))

    def step():
        opt.zero_grad(set_to_none=True)
        model(tokens, labels=labels).float().mean().backward()
        update_fp8_scales(model)
        opt.step()

    return _median_time(step, device, args.steps)


def bench_step(c, args, device) -> dict[str, float]:
    print(f"\n== GPT training step (median of {args.steps} after 1 warm-up): {c['layers']} layers, hidden {c['hidden']}, "
          f"{c['heads']} heads, seq {c['seq']}, batch {c['batch']}, vocab {c['vocab']}, AdamW ==")
    steps = {"fp32": _gpt_step(c, args, device, torch.float32, None),
             "bf16": _gpt_step(c, args, device, torch.bfloat16, None)}
    for recipe in args.fp8_recipe:
        steps[f"fp8 {recipe}"] = _gpt_step(c, args, device, torch.bfloat16, recipe)
    for name, seconds in steps.items():
        print(f"{name + (' (bf16 params)' if name.startswith('fp8') else ''):28s} {seconds * 1e3:10.1f} ms")
    return steps


def main(argv=None):
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--issue-config", action="store_true", help="6 layers, hidden 768, seq 512, batch 4, vocab 32768")
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--fp8-format", default="hybrid", choices=["e4m3", "hybrid"])
    p.add_argument("--fp8-recipe", nargs="+", default=["delayed"], choices=FP8_RECIPES,
                   help="one or more recipes, measured side by side (blockwise and mxfp8 scale blocks of 128 and 32 "
                   "values; a dimension that is not a multiple ends in a partial block)")
    args = p.parse_args(argv)
    c = ISSUE if args.issue_config else SMALL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.fp8_recipe = list(dict.fromkeys(args.fp8_recipe))  # each once, in the order given
    recipes = [Fp8Recipe(format=args.fp8_format, recipe=name) for name in args.fp8_recipe]
    print(describe_machine())
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    for recipe in recipes:
        print(f"> {describe_fp8_path(recipe, device)}")
    peaks = gemm_peaks(c["hidden"], device, args.steps)
    print(f"GEMM peak, {c['hidden']}^3: fp32 {peaks['fp32']:.3f} TFLOP/s, bf16 {peaks['bf16']:.3f} TFLOP/s "
          f"(bf16 / fp32 {peaks['bf16'] / peaks['fp32']:.2f}x)")
    if fp8_gemm_path(device) == DEQUANTISED:
        kernel, ours = cpu_scaled_mm_probe(device)
        print(f"torch._scaled_mm 256^3 on this CPU (emulated): {kernel:.2f} GFLOP/s; the dequantised GEMM used "
              f"instead: {ours:.2f} GFLOP/s ({ours / kernel:.2f}x)")
    bench_gemms(c, recipes, device, args.steps)
    steps = bench_step(c, args, device)
    judged = peaks["bf16"] >= peaks["fp32"]
    ratios = ", ".join(f"{name} {steps[f'fp8 {name}'] / steps['bf16']:.2f}x (vs fp32 "
                       f"{steps[f'fp8 {name}'] / steps['fp32']:.2f}x)" for name in args.fp8_recipe)
    print(f"\nsummary: FP8 step / bf16 step (target <= 1.3x): {ratios}; " + ("this device has a fast bf16 path: the target is judged here" if judged else
          "bf16 GEMMs are slower than fp32 here (no bf16 matrix units), so the bf16 step is no yardstick: "
          "judge the target where bf16 is the faster GEMM; here FP8 runs fp32 GEMMs and is compared with fp32"))


if __name__ == "__main__":
    main()
