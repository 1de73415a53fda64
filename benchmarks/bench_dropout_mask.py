"""The CPU dropout masks of one training step: ``keep_mask`` against other ways to draw them.

One step of ``bench_step.py``'s issue config (6 layers, hidden 768, 12 heads, seq 512, batch 4,
dropout 0.1) draws 13 hidden/embedding masks of ``512 x 4 x 768`` and, per layer, the causal
attention's four query blocks ``48 x 128 x (128, 256, 384, 512)``: 67.6 M entries. Each way draws all
of them, the ways taking turns round by round (the order alternating), and the medians and the
paired ratios against ``keep_mask`` are printed; then the same for one tiny mask (``4 x 32 x 32``,
where a fixed cost per call would show):

* ``keep_mask``: SFC64 chunks on ``torch.get_num_threads()`` threads (``fusions/dropout.py``);
* ``torch lanes``: the same 16-bit lanes from PyTorch's CPU generator (``random_`` on int64 words);
* ``rand < p`` and ``bernoulli_``: PyTorch's float draws into a boolean / uint8 mask.

    python benchmarks/bench_dropout_mask.py [--rounds 9] [--threads 2] [--p 0.1]
"""

from __future__ import annotations

import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int, probability, timed  # noqa: E402
from megatron_lite.fusions.dropout import keep_mask  # noqa: E402

STEP_SHAPES = [(512, 4, 768)] * 13 + [(48, 128, 128 * k) for k in range(1, 5)] * 6


def torch_lanes(shape, p: float) -> torch.Tensor:
    """Four 16-bit lanes per 64-bit word from PyTorch's generator, compared into a uint8 0/1 mask."""
    n = math.prod(shape)
    words = torch.empty(-(-n // 4), dtype=torch.int64).random_(-(2**63), None)
    keep = torch.empty(shape, dtype=torch.uint8)
    return torch.ge(words.view(torch.int16)[:n].view(shape), round(p * 2**16) - 2**15, out=keep)


WAYS = {
    "keep_mask": keep_mask,
    "torch lanes": torch_lanes,
    "rand < p": lambda shape, p: torch.rand(shape) >= p,
    "bernoulli_": lambda shape, p: torch.empty(shape, dtype=torch.uint8).bernoulli_(1 - p),
}


def main(argv=None) -> None:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=positive_int, default=9)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--p", type=probability, default=0.1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(describe_machine(args.threads))
    print(f"masks of one step: {len(STEP_SHAPES)}, {sum(math.prod(s) for s in STEP_SHAPES) / 1e6:.1f} M entries, p {args.p}")

    compare(STEP_SHAPES, args.rounds, args.p, "ms per step", 1e3)
    compare([(4, 32, 32)] * 100, args.rounds, args.p, "us per tiny mask (4 x 32 x 32)", 1e6 / 100)


def compare(shapes, rounds: int, p: float, unit: str, per_second: float) -> None:
    """Each way draws ``shapes`` once per round, the ways taking turns; a table of medians and ratios."""

    def draw(way):
        return lambda: [way(shape, p) for shape in shapes]

    times = {name: [] for name in WAYS}
    names = list(WAYS)
    for name in names:
        draw(WAYS[name])()  # warm-up: the thread pool, first-touch pages
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(timed(draw(WAYS[name])))
    print(f"| way | {unit} (median) | vs keep_mask (paired median, min-max) |\n|---|---|---|")
    for name in names:
        ratios = [t / k for t, k in zip(times[name], times["keep_mask"])]
        print(f"| {name} | {statistics.median(times[name]) * per_second:.1f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
