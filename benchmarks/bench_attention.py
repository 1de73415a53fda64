"""Core attention alone, forward + backward: the CPU paths side by side, time and saved memory.

The paths: PyTorch's ``scaled_dot_product_attention`` (SDPA; without attention dropout),
``cpu_core_attention`` (the blocked CPU attention; with dropout always, without it where
``beats_cpu_sdpa`` says it is faster: the "layer runs" column), and ``--no-masked-softmax-fusion``'s
explicit math ``unfused_attention`` (scores, mask, softmax, dropout, product: one operation each,
its ``seq x seq`` probabilities kept for the backward). Causal, ``heads`` heads of 64 channels in
the layer's layout (views of ``[s, b, heads, d]``), ``tokens / seq`` sequences per batch (the same
tokens at each length). The paths alternate round by round in one process; each path's figure
against the first (SDPA without dropout, cpu_core_attention with it) is the median of the
per-round ratios path / first (above 1: the path is slower). "Saved" is what autograd keeps for
the backward (the distinct storages its saved tensors use), read with ``saved_tensors_hooks``.

    python benchmarks/bench_attention.py [--seqs 512 2048] [--dtypes bf16 fp32] [--threads 2] [--dropout 0.1]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int, probability  # noqa: E402
from megatron_lite.models.attention import unfused_attention  # noqa: E402
from megatron_lite.models.cpu_attention import beats_cpu_sdpa, cpu_core_attention  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def paths(dropout: float, scale: float) -> dict:
    """name -> f(q, k, v) of each path, each returning ``[b, heads, s, d]``; the first is the baseline."""
    runs = {} if dropout > 0 else {
        "SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)}
    runs["cpu_core_attention"] = lambda q, k, v: cpu_core_attention(q, k, v, None, True, dropout, scale)

    def explicit(q, k, v):
        b, h, s, d = q.shape
        return unfused_attention(q, k, v, None, True, dropout, scale).reshape(s, b, h, d).permute(1, 2, 0, 3)

    runs["explicit"] = explicit
    return runs


def saved_bytes(fn, q, k, v) -> int:
    """Bytes of the distinct storages autograd saves for the backward of ``fn(q, k, v)`` (inputs included)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(q, k, v)
    del out
    return sum(storages.values())


def inputs(batch: int, heads: int, seq: int, dtype: torch.dtype):
    """q, k, v ``[b, heads, s, 64]`` in the layer's layout: views of ``[s, b, heads, 64]`` tensors (the
    QKV projection's output), as core attention receives them."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(seq, batch, heads, 64, generator=gen).to(dtype).requires_grad_().permute(1, 2, 0, 3)
            for _ in range(3)]


def fwd_bwd(fn, q, k, v, grad) -> float:
    start = time.perf_counter()
    fn(q, k, v).backward(grad)
    return time.perf_counter() - start


def measure(seq: int, dtype: torch.dtype, args) -> dict:
    batch = max(1, args.tokens // seq)
    q, k, v = inputs(batch, args.heads, seq, dtype)
    grad = torch.randn(batch, args.heads, seq, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    runs = paths(args.dropout, 64 ** -0.5)
    for fn in runs.values():
        fwd_bwd(fn, q, k, v, grad)  # warm-up
    names, times = list(runs), {name: [] for name in runs}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(fwd_bwd(runs[name], q, k, v, grad))
    first = names[0]
    layer = "SDPA" if args.dropout == 0 and not beats_cpu_sdpa(q, k, None, True) else "cpu_core_attention"
    return {"batch": batch, "layer": layer, "times": times,
            "ratios": {name: [t / f for t, f in zip(times[name], times[first], strict=True)] for name in names},
            "saved": {name: saved_bytes(fn, q, k, v) for name, fn in runs.items()}}


def parse(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=positive_int, nargs="+", default=[512, 2048])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens per batch (batch = tokens / seq)")
    p.add_argument("--heads", type=positive_int, default=12)
    p.add_argument("--rounds", type=positive_int, default=7)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--dropout", type=probability, default=0.0,
                   help="attention dropout (0: SDPA is measured too; above 0 it has no CPU kernel)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(args.threads)
    print(describe_machine(args.threads))
    print(f"causal, {args.heads} heads x 64, {args.tokens} tokens per batch, dropout {args.dropout}, "
          f"{args.rounds} rounds; ratio = path / first path (above 1: slower)")
    print("\n| seq x batch | dtype | path | layer runs | fwd+bwd | vs first (rounds) | saved |\n"
          "|---|---|---|---|---|---|---|")
    for seq in args.seqs:
        for name in args.dtypes:
            m = measure(seq, DTYPES[name], args)
            for path, times in m["times"].items():
                r = m["ratios"][path]
                print(f"| {seq} x {m['batch']} | {name} | {path} | {'yes' if path == m['layer'] else ''} | "
                      f"{statistics.median(times) * 1e3:.0f} ms | {statistics.median(r):.2f}x "
                      f"({min(r):.2f}-{max(r):.2f}) | {m['saved'][path] / 2**20:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
