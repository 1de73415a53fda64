"""The fused functions' eager path on a CPU (``--jit-fuser auto``'s choice there) against the unfused code.

Each of Megatron's fusions (``megatron_lite/fusions/`` and the model's ``jit_fuser`` functions), forward +
backward, fused (as a default CPU run calls it: eager) vs the unfused operations with the same math:

* bias + GeLU: ``bias_gelu_impl(y, b)`` vs ``F.gelu(y + b, approximate="tanh")`` with autograd;
* bias + SwiGLU: ``bias_swiglu_impl(y, b)`` vs ``silu(x1) * x2`` of ``y + b`` (and without the bias);
* bias + dropout + residual: ``bias_dropout_add`` vs ``residual + dropout(x + b)`` (p 0.1, and eval);
* rotary embedding: ``fused_apply_rotary`` vs ``apply_rotary``;
* cross-entropy: ``vocab_parallel_cross_entropy(fused=True)`` vs ``fused=False``;
* masked softmax: SDPA (``--masked-softmax-fusion``) vs the explicit math (causal, no dropout).

Shapes: a tiny ``[32, 128]`` (where the per-call cost shows) and ``[2048, 3072]`` (an MLP's fc1 output),
fp32 and bf16 (``--shapes`` / ``--dtypes`` to change). The variants alternate round by round in one
process; the figure is the median of the per-round ratios unfused / fused (above 1: fused is faster).

    python benchmarks/bench_fusions.py [--rounds 7] [--threads 1] [--only gelu swiglu ...]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _gelu(shape, dtype):
    from megatron_lite.fusions.activations import bias_gelu_impl

    y, b = torch.randn(shape, dtype=dtype), torch.randn(shape[-1], dtype=dtype)
    return _pair(lambda y, b: bias_gelu_impl(y, b), lambda y, b: F.gelu(y + b, approximate="tanh"), y, b)


def _swiglu(shape, dtype, bias=True):
    from megatron_lite.fusions.activations import bias_swiglu_impl

    y = torch.randn(shape, dtype=dtype)
    b = torch.randn(shape[-1], dtype=dtype) if bias else None

    def unfused(y, b=None):
        x = y if b is None else y + b
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up

    return _pair(lambda y, b=None: bias_swiglu_impl(y, b), unfused, y, *([b] if bias else []))


def _bda(shape, dtype, p):
    from megatron_lite.fusions.dropout import dropout
    from megatron_lite.fusions.residual import bias_dropout_add

    x, b, r = torch.randn(shape, dtype=dtype), torch.randn(shape[-1], dtype=dtype), torch.randn(shape, dtype=dtype)
    return _pair(lambda x, b, r: bias_dropout_add(x, b, r, p, p > 0),
                 lambda x, b, r: r + (dropout(x + b, p) if p > 0 else x + b), x, b, r)


def _rope(shape, dtype):
    from megatron_lite.models.attention import fused_apply_rotary
    from megatron_lite.models.common import apply_rotary

    s, d = shape[0], 64
    x = torch.randn(s, 1, shape[1] // d, d, dtype=dtype)
    cos, sin = torch.randn(s, 1, 1, d, dtype=dtype), torch.randn(s, 1, 1, d, dtype=dtype)
    return _pair(lambda x: fused_apply_rotary(x, cos, sin), lambda x: apply_rotary(x, cos, sin), x)


def _cross_entropy(shape, dtype):
    from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy

    logits, target = torch.randn(shape, dtype=dtype), torch.randint(0, shape[-1], shape[:1])
    return _pair(lambda x: vocab_parallel_cross_entropy(x, target, fused=True),
                 lambda x: vocab_parallel_cross_entropy(x, target, fused=False), logits)


def _softmax(shape, dtype):
    from megatron_lite.models.attention import unfused_attention

    s, d = min(shape[0], 512), 64
    heads = max(1, shape[0] * shape[1] // (s * s))  # about as many scores as the shape has entries
    q, k, v = (torch.randn(1, heads, s, d, dtype=dtype) for _ in range(3))

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, 1, heads * d)

    return _pair(sdpa, lambda q, k, v: unfused_attention(q, k, v, None, True, 0.0, d ** -0.5), q, k, v)


def _pair(fused, unfused, *inputs):
    """No-argument fwd + bwd closures of both variants (fresh leaves each call), and their max difference."""
    def step(fn):
        def run():
            leaves = [t.detach().requires_grad_() for t in inputs]
            fn(*leaves).float().sum().backward()
        return run
    with torch.no_grad():  # the same seed for both: the dropout cases draw the same mask
        torch.manual_seed(1)
        out = fused(*inputs).float()
        torch.manual_seed(1)
        diff = (out - unfused(*inputs).float()).abs().max().item()
    return {"unfused": step(unfused), "fused": step(fused)}, diff


CASES = {
    "gelu": ("bias + GeLU (tanh)", _gelu),
    "swiglu": ("bias + SwiGLU", _swiglu),
    "swiglu-nobias": ("SwiGLU, no bias", lambda s, d: _swiglu(s, d, bias=False)),
    "bda": ("bias + dropout 0.1 + residual", lambda s, d: _bda(s, d, 0.1)),
    "bda-eval": ("bias + residual (eval)", lambda s, d: _bda(s, d, 0.0)),
    "rope": ("rotary embedding", _rope),
    "cross-entropy": ("vocab cross-entropy", _cross_entropy),
    "softmax": ("causal attention (masked softmax)", _softmax),
}


def alternate(runs: dict, rounds: int, min_seconds: float) -> dict[str, list[float]]:
    """Seconds per call of each variant per round, the order reversed every other round (each round
    repeats a variant for at least ``min_seconds``)."""
    reps = {}
    for name, fn in runs.items():  # warm up, and size the repeats
        fn()
        start = time.perf_counter()
        fn()
        reps[name] = max(1, int(min_seconds / max(time.perf_counter() - start, 1e-7)))
    reps = dict.fromkeys(runs, max(reps.values()))  # both variants the same count per round
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            for _ in range(reps[name]):
                runs[name]()
            times[name].append((time.perf_counter() - start) / reps[name])
    return times


def main(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=positive_int, default=7)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--only", nargs="+", choices=sorted(CASES), help="these fusions only (default: all)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--shapes", nargs="+", default=["32x128", "2048x3072"], help="ROWSxCOLS (default: 32x128 2048x3072)")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(n) for n in s.lower().split("x")) for s in args.shapes]
    except ValueError:
        p.error(f"--shapes {' '.join(args.shapes)}: give each as ROWSxCOLS, e.g. 32x128")
    if any(len(s) != 2 or min(s) < 1 or s[1] % 128 for s in shapes):
        p.error(f"--shapes {' '.join(args.shapes)}: two positive sizes each, the second a multiple of 128")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(describe_machine(args.threads))
    print("fwd + bwd per call; ratio = unfused / fused, median of per-round ratios (>1: the fused path is faster)")
    print("\n| fusion | shape | dtype | unfused | fused | unfused / fused (rounds) | max diff |\n|---|---|---|---|---|---|---|")
    for key in args.only or list(CASES):
        title, make = CASES[key]
        for shape in shapes:
            for dtype in args.dtypes:
                runs, diff = make(shape, DTYPES[dtype])
                t = alternate(runs, args.rounds, 0.05)
                ratios = [u / f for u, f in zip(t["unfused"], t["fused"], strict=True)]
                print(f"| {title} | {shape[0]}x{shape[1]} | {dtype} | {_fmt(t['unfused'])} | {_fmt(t['fused'])} | "
                      f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) | {diff:.1e} |",
                      flush=True)


def _fmt(seconds: list[float]) -> str:
    m = statistics.median(seconds)
    return f"{m * 1e6:.0f} us" if m < 1e-3 else f"{m * 1e3:.2f} ms"


if __name__ == "__main__":
    main()
