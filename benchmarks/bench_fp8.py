"""FP8 vs bf16: GEMM-only throughput and a GEMM-bound layer stack's training step, in one run.

Runs on the GPU when one is visible (else the CPU) and prints the device, so the same command
measures a laptop, this CPU or an H100:

* GEMM only: the three GEMMs of a linear layer (forward ``X W^T``, dgrad ``dY W``, wgrad ``dY^T X``)
  for each linear shape of a transformer layer, bf16 ``torch.matmul`` vs ``torch._scaled_mm`` on
  operands already in FP8 (the kernel alone), and vs the full :class:`Fp8Gemm` call (quantisation
  included). TFLOP/s counts 2*M*N*K per GEMM.
* Training step, forward + backward + SGD update with bf16 weights, plain GEMMs vs FP8 (recipe
  from the flags; the delayed recipe's scale update runs once per step as in training): the
  project's ``GPTModel`` (``--layers`` layers, a small ``--vocab`` so the step stays GEMM-bound;
  FP8 in QKV/projection/fc1/fc2 as in training), and a stack of the transformer's GEMM-bound part
  alone (LayerNorm, QKV, a cheap elementwise stand-in for attention, projection, LayerNorm, fc1,
  GELU, fc2, residuals) with every linear through the same GEMM seam.

    python benchmarks/bench_fp8.py [--hidden 1024] [--seq 256] [--batch 1] [--layers 2] [--vocab 1024]
                                   [--steps 5] [--fp8-format hybrid] [--fp8-recipe delayed]

Ratios > 1 mean FP8 is faster. On a shared CPU the numbers are noisy: the median of ``--steps``
timed repetitions is reported, after warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import describe_machine  # noqa: E402
from megatron_lite.models import GPTModel, TransformerConfig  # noqa: E402
from megatron_lite.parallel.state import ParallelState  # noqa: E402
from megatron_lite.precision.fp8 import Fp8Gemm, Fp8Recipe, update_fp8_scales  # noqa: E402
from megatron_lite.precision.fp8_ops import E4M3, E5M2, column_major, quantize  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device, steps, warmup=2) -> float:
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


def _gemm_shapes(hidden, ffn, tokens):
    """(name, M, K, N) of a transformer layer's linears: Y[M, N] = X[M, K] W[N, K]^T."""
    return [("qkv", tokens, hidden, 3 * hidden), ("proj", tokens, hidden, hidden),
            ("fc1", tokens, hidden, ffn), ("fc2", tokens, ffn, hidden)]


def _time_shape(m, k, n, recipe, device, steps) -> dict[str, float]:
    """Seconds for forward + dgrad + wgrad of one linear: bf16, FP8 kernel only, Fp8Gemm call."""
    one = torch.ones((), device=device)
    x, w, dy = (torch.randn(s, device=device) for s in ((m, k), (n, k), (m, n)))
    xb, wb, dyb = x.bfloat16(), w.bfloat16(), dy.bfloat16()
    x8, w8, dy8 = quantize(x, one, E4M3), quantize(w, one, E4M3), quantize(dy, one, E5M2)
    pairs = ((x8, w8.t()), (dy8, column_major(w8)), (dy8.t().contiguous(), column_major(x8)))
    gemm = Fp8Gemm(recipe).to(device)
    xr, wr = xb.clone().requires_grad_(), wb.clone().requires_grad_()

    def bf16():
        xb @ wb.t(), dyb @ wb, dyb.t() @ xb

    def kernel():
        for a, b in pairs:
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    def module():
        gemm(xr, wr).backward(dyb)

    return {"bf16": _median_time(bf16, device, steps), "kernel": _median_time(kernel, device, steps),
            "module": _median_time(module, device, steps)}


def bench_gemms(args, device):
    print("\n== GEMM only: forward + dgrad + wgrad of each linear (median of steps) ==")
    print(f"{'gemm':6s} {'M x K x N':>18s} {'bf16 TFLOP/s':>13s} {'fp8 kernel':>11s} {'ratio':>6s} "
          f"{'Fp8Gemm':>9s} {'ratio':>6s}")
    totals = {"bf16": 0.0, "kernel": 0.0, "module": 0.0}
    flops_all = 0
    recipe = Fp8Recipe(format=args.fp8_format, recipe=args.fp8_recipe)
    for name, m, k, n in _gemm_shapes(args.hidden, 4 * args.hidden, args.seq * args.batch):
        t = _time_shape(m, k, n, recipe, device, args.steps)
        flops = 3 * 2 * m * n * k
        for key in totals:
            totals[key] += t[key]
        flops_all += flops
        tf = {key: flops / v / 1e12 for key, v in t.items()}
        print(f"{name:6s} {f'{m}x{k}x{n}':>18s} {tf['bf16']:13.3f} {tf['kernel']:11.3f} "
              f"{t['bf16'] / t['kernel']:6.2f} {tf['module']:9.3f} {t['bf16'] / t['module']:6.2f}")
    print(f"{'all':6s} {'':>18s} {flops_all / totals['bf16'] / 1e12:13.3f} {flops_all / totals['kernel'] / 1e12:11.3f} "
          f"{totals['bf16'] / totals['kernel']:6.2f} {flops_all / totals['module'] / 1e12:9.3f} "
          f"{totals['bf16'] / totals['module']:6.2f}")
    return totals["bf16"] / totals["kernel"], totals["bf16"] / totals["module"]


class Block(nn.Module):
    """The GEMM-bound part of a transformer layer; every linear goes through ``gemm``."""

    def __init__(self, hidden, make_gemm):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        shapes = {"qkv": (3 * hidden, hidden), "proj": (hidden, hidden), "fc1": (4 * hidden, hidden),
                  "fc2": (hidden, 4 * hidden)}
        self.weights = nn.ParameterDict({k: nn.Parameter(torch.randn(s) * 0.02) for k, s in shapes.items()})
        self.gemms = nn.ModuleDict({k: g for k in shapes if (g := make_gemm()) is not None})

    def _linear(self, name, x):
        gemm = self.gemms[name] if name in self.gemms else F.linear
        return gemm(x, self.weights[name])

    def forward(self, x):
        q, k, v = self._linear("qkv", self.norm1(x)).chunk(3, dim=-1)
        x = x + self._linear("proj", torch.tanh(q) * k + v)  # cheap stand-in for attention
        return x + self._linear("fc2", F.gelu(self._linear("fc1", self.norm2(x))))


def _time_step(args, device, make_gemm) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.hidden, make_gemm) for _ in range(args.layers)]).to(device, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.seq, args.batch, args.hidden, device=device, dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        update_fp8_scales(model)  # the once-per-step delayed-scaling update (no-op for bf16)
        opt.step()

    return _median_time(step, device, args.steps)


def _time_gpt_step(args, device, fp8: bool) -> float:
    """Forward + backward + SGD of the project's GPTModel (bf16), FP8 linears when ``fp8``."""
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 64),
                            seq_length=args.seq, vocab_size=args.vocab, attention_dropout=0.0, hidden_dropout=0.0,
                            params_dtype=torch.bfloat16, fp8=args.fp8_format if fp8 else None,
                            fp8_recipe=args.fp8_recipe)
    model = GPTModel(cfg, ParallelState()).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device) for _ in range(2))

    def step():
        opt.zero_grad(set_to_none=True)
        model(tokens, labels=labels).float().mean().backward()
        update_fp8_scales(model)
        opt.step()

    return _median_time(step, device, args.steps)


def bench_step(args, device) -> dict[str, float]:
    recipe = Fp8Recipe(format=args.fp8_format, recipe=args.fp8_recipe)
    print(f"\n== training step (median of steps): {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"batch {args.batch}, bf16 weights ==")
    print(f"{'model':40s} {'bf16 ms':>9s} {'fp8 ms':>9s} {'speed-up':>9s}")
    rows = {
        f"GPTModel (vocab {args.vocab})": (_time_gpt_step(args, device, False), _time_gpt_step(args, device, True)),
        "GEMM-bound block stack (no attention)": (_time_step(args, device, lambda: None),
                                                  _time_step(args, device, lambda: Fp8Gemm(recipe))),
    }
    for name, (bf16, fp8) in rows.items():
        print(f"{name:40s} {bf16 * 1e3:9.1f} {fp8 * 1e3:9.1f} {bf16 / fp8:8.2f}x")
    return {name: bf16 / fp8 for name, (bf16, fp8) in rows.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=1024, help="GPT vocabulary (small, so the step stays GEMM-bound)")
    p.add_argument("--fp8-format", default="hybrid", choices=["e4m3", "hybrid"])
    p.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise"])
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(describe_machine())
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"fp8 {args.fp8_format}/{args.fp8_recipe}")
    kernel_ratio, module_ratio = bench_gemms(args, device)
    steps = ", ".join(f"{name} {r:.2f}x" for name, r in bench_step(args, device).items())
    print(f"\nsummary: GEMM-only fp8/bf16 speed-up {kernel_ratio:.2f}x (kernel), {module_ratio:.2f}x "
          f"(Fp8Gemm incl. quantisation); training step: {steps}")


if __name__ == "__main__":
    main()
