"""The GEMMs of one training step, alone, in the layouts our linear layers use and in the alternatives.

On a CPU with bf16 matrix units (Intel AMX) the issue-21 step's GEMMs did not run at the machine's
GEMM peak: QKV and the attention projection reached 1.2-1.95 TFLOP/s at 2 threads, fc1, fc2 and the
output layer 0.5-1.0. This prints, for each linear of the step (``tokens`` rows) and each of its three
products, the time and rate of every layout, so the one to use can be chosen from measurements:

- forward ``Y = X W^T``: ``F.linear`` with the weight as stored ``[out, in]`` (ours), or a copy of the
  weight stored transposed (``X @ Wt``);
- input gradient ``dX = dY W``: ours, or through the transposed copy (``dY @ Wt^T``);
- weight gradient ``dW = dY^T X``: ours (``dY^T`` a view), with ``dY^T`` made contiguous first (the
  copy is timed with it), or as ``(X^T dY)^T``;
- each pass cut into ``--blocks`` smaller products (of the weight's rows, of the tokens, of the inner
  dimension accumulated in place): whether a smaller operand reaches the matrix units' pace.

Every round times every variant once, in alternating order, and the square ``n x n`` products (the
peak ``bench_step.py`` reads) once, so a drifting machine moves them all alike; medians are printed,
and the step's total per layout (each linear times its count per step).

    python benchmarks/bench_gemm_layouts.py [--dtype bf16] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int, timed  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def linears(hidden: int, ffn: int, vocab: int, layers: int) -> dict[str, tuple[int, int, int]]:
    """name -> (in features, out features, how many per step) of a GPT's linears (the output layer once)."""
    return {"qkv": (hidden, 3 * hidden, layers), "proj": (hidden, hidden, layers), "fc1": (hidden, ffn, layers),
            "fc2": (ffn, hidden, layers), "output layer": (hidden, vocab, 1)}


def _blocks(size: int, count: int) -> list[slice]:
    edges = [size * i // count for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(edges, edges[1:], strict=False)]


def _in_k_blocks(a: torch.Tensor, b: torch.Tensor, count: int) -> torch.Tensor:
    """``a @ b`` as a sum of products over blocks of the inner dimension, accumulated in place."""
    parts = _blocks(a.shape[1], count)
    out = a[:, parts[0]] @ b[parts[0]]
    for part in parts[1:]:
        out.addmm_(a[:, part], b[part])
    return out


def _in_row_blocks_of_dw(dy: torch.Tensor, x: torch.Tensor, count: int) -> torch.Tensor:
    dw = torch.empty(dy.shape[1], x.shape[1], dtype=x.dtype)
    for part in _blocks(dy.shape[1], count):
        torch.mm(dy[:, part].t(), x, out=dw[part])
    return dw


def variants(tokens: int, k: int, n: int, dtype: torch.dtype, blocks: int) -> dict[tuple[str, str], object]:
    """(pass, layout) -> a no-argument function computing that product."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    dy = torch.randn(tokens, n, generator=gen).to(dtype)
    wt = w.t().contiguous()
    rows, cols = _blocks(tokens, blocks), _blocks(n, blocks)
    return {
        ("forward", "F.linear(X, W) (ours)"): lambda: F.linear(x, w),
        ("forward", "X @ Wt, W stored transposed"): lambda: x @ wt,
        ("input grad", "dY @ W (ours)"): lambda: dy @ w,
        ("input grad", "dY @ Wt^T, W stored transposed"): lambda: dy @ wt.t(),
        ("weight grad", "dY^T @ X, a view (ours)"): lambda: dy.t() @ x,
        ("weight grad", "dY^T made contiguous, then @ X"): lambda: dy.t().contiguous() @ x,
        ("weight grad", "(X^T @ dY)^T"): lambda: (x.t() @ dy).t(),
        ("forward", f"{blocks} blocks of W's rows (output columns)"): lambda: [F.linear(x, w[c]) for c in cols],
        ("forward", f"{blocks} blocks of tokens"): lambda: [F.linear(x[r], w) for r in rows],
        ("input grad", f"{blocks} blocks of the inner dimension, accumulated"): lambda: _in_k_blocks(dy, w, blocks),
        ("input grad", f"{blocks} blocks of tokens"): lambda: [dy[r] @ w for r in rows],
        ("weight grad", f"{blocks} blocks of dW's rows"): lambda: _in_row_blocks_of_dw(dy, x, blocks),
    }


def squares(dtype: torch.dtype) -> dict[int, object]:
    """n -> an ``n x n x n`` product (the peak ``bench_step.py`` reads)."""
    out = {}
    for n in (2048, 3072):
        gen = torch.Generator().manual_seed(n)
        a, b = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
        out[n] = lambda a=a, b=b: a @ b
    return out


def main(argv=None) -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--tokens", type=positive_int, default=2048, help="rows of every product (micro-batch x sequence)")
    p.add_argument("--hidden", type=positive_int, default=768)
    p.add_argument("--ffn", type=positive_int, default=3072)
    p.add_argument("--vocab", type=positive_int, default=32768)
    p.add_argument("--layers", type=positive_int, default=6)
    p.add_argument("--blocks", type=positive_int, default=4, help="the blocked variants cut a product into this many")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print(describe_machine(args.threads))
    shapes = linears(args.hidden, args.ffn, args.vocab, args.layers)
    cases = {}  # (linear, pass, layout) -> (function, FLOPs, count per step)
    for name, (k, n, count) in shapes.items():
        for (kind, layout), fn in variants(args.tokens, k, n, dtype, args.blocks).items():
            cases[(name, kind, layout)] = (fn, 2 * args.tokens * k * n, count)
    for n, fn in squares(dtype).items():
        cases[("peak (n x n x n)", "square", f"n = {n}")] = (fn, 2 * n**3, 0)
    for fn, _, _ in cases.values():  # warm-up: oneDNN's first call of a shape picks its kernel
        fn()
    times = {key: [] for key in cases}
    for r in range(args.rounds):
        for key in (list(cases) if r % 2 == 0 else reversed(list(cases))):
            times[key].append(timed(cases[key][0]))
        print(f"round {r + 1} done", flush=True)
    print(f"\n{args.dtype}, {args.tokens} tokens, median of {args.rounds} rounds\n\n"
          "| linear | product | layout | ms | TFLOP/s |\n|---|---|---|---|---|")
    totals = {}
    for (name, kind, layout), (_, flop, count) in cases.items():
        med = statistics.median(times[(name, kind, layout)])
        print(f"| {name} | {kind} | {layout} | {med * 1e3:.1f} | {flop / med / 1e12:.2f} |")
        if count:
            totals[(kind, layout)] = totals.get((kind, layout), 0.0) + count * med
    print("\nper step (each linear times its count):\n\n| product | layout | ms |\n|---|---|---|")
    passes = ["forward", "input grad", "weight grad"]
    for (kind, layout), total in sorted(totals.items(), key=lambda item: passes.index(item[0][0])):
        print(f"| {kind} | {layout} | {total * 1e3:.0f} |")


if __name__ == "__main__":
    main()
