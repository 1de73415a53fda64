#!/usr/bin/env python3
"""Draw a pipeline schedule's timeline as a PNG (and print it as a text grid).

The per-rank op order comes from megatron_lite.parallel.pipeline.order — the functions the real
schedules run — laid out by the equal-cost simulator (forward 1 unit, backward --backward-cost
units per stage; a chunk of the interleaved schedule costs 1/v of that; communication is free).
With ``--schedule zb-h1`` the backward is split into B (input gradient, hatched) and W (weight
gradients, dotted), --weight-cost of the backward's units going to W. The title gives the measured
bubble fraction (idle / busy time over all ranks) beside the formula: (p-1)/m, (p-1)/(v*m) with
interleaving, (p-1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W)) for ZB-H1 ((p-1)/(3m) at equal costs).
``--schedule zb-h1 -v 2`` draws interleaved zero bubble, whose formula is ZB-H1's over v; its W
passes are placed for equal F, B and W costs, where it reaches that formula once m >= 2p.

    python tools/plot_schedule.py -p 4 -m 8 --out 1f1b.png
    python tools/plot_schedule.py -p 4 -m 8 -v 2 --compare --out interleaved.png
    python tools/plot_schedule.py -p 4 -m 8 --schedule zb-h1 --compare --out zb.png
    python tools/plot_schedule.py -p 4 -m 8 -v 2 --schedule zb-h1 --compare --out zbv.png
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.errors import ConfigError, OneLineParser, run_tool  # noqa: E402
from megatron_lite.parallel.pipeline.order import check_interleaved_microbatches  # noqa: E402
from megatron_lite.parallel.pipeline.trace import (  # noqa: E402
    bubble_fraction,
    render_grid,
    simulate,
    simulated_orders,
)
from megatron_lite.training.outputs import check_output_file, save_figure  # noqa: E402


def schedule(p: int, m: int, v: int, backward_cost: float, kind: str = "1f1b", weight_cost: float = 0.5):
    """(timeline, bubble fraction, formula, name) of one schedule under equal costs."""
    if kind == "zb-h1" and p > 1:
        t_b, t_w = backward_cost - weight_cost, weight_cost
        timeline = simulate(simulated_orders(p, m, v, kind), p, v, 1.0 / v, t_b / v, t_w / v)
        formula = (p - 1) * (1.0 + t_b - t_w) / (v * m * (1.0 + t_b + t_w))
        return timeline, bubble_fraction(timeline), formula, f"zero bubble interleaved (v={v})" if v > 1 else "ZB-H1"
    timeline = simulate(simulated_orders(p, m, v), p, v, 1.0 / v, backward_cost / v)
    name = "no pipelining" if p == 1 else (f"interleaved 1F1B (v={v})" if v > 1 else "1F1B")
    return timeline, bubble_fraction(timeline), (p - 1) / (v * m), name


MAX_INCHES = (80, 50)  # at dpi 120


def draw(ax, timeline, p, m, title, label_min_width=0.0):
    """One bar per operation (one barh call per rank and kind: a 64 x 512 schedule has ~100k bars);
    labels only on bars at least ``label_min_width`` time units wide (narrower ones would overlap)."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab20")
    for r, ops in timeline.items():
        chunked = any(op[2] for op, _, _ in ops)
        for kind in ("F", "B", "W"):
            mine = [(mb, chunk, start, end) for (k, mb, chunk), start, end in ops if k == kind]
            if not mine:
                continue
            ax.barh([r] * len(mine), [e - s for _, _, s, e in mine], left=[s for _, _, s, _ in mine], height=0.8,
                    color=[colors((2 * mb + (kind != "F")) % 20) for mb, _, _, _ in mine], edgecolor="black",
                    linewidth=0.5, hatch={"B": "//", "W": ".."}.get(kind))
            for mb, chunk, start, end in mine:
                if end - start >= label_min_width:
                    label = f"{kind}{mb}" + (chr(ord("a") + chunk) if chunked else "")
                    ax.text((start + end) / 2, r, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward of one full stage = 1)")
    ax.set_title(title, fontsize=10)


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-p", "--pipeline-model-parallel-size", type=int, required=True, dest="p")
    ap.add_argument("-m", "--num-microbatches", type=int, required=True, dest="m")
    ap.add_argument("-v", "--model-chunks", type=int, default=1, dest="v",
                    help="model chunks per rank (num-layers / (pp x num-layers-per-virtual-pipeline-stage))")
    ap.add_argument("--backward-cost", type=float, default=2.0, help="backward time / forward time (default 2)")
    ap.add_argument("--schedule", choices=["1f1b", "zb-h1"], default="1f1b",
                    help="1f1b or zb-h1 (backward split into B and W); both interleaved with -v > 1")
    ap.add_argument("--weight-cost", type=float, default=None,
                    help="zb-h1: the part of --backward-cost spent in W (default half of it)")
    ap.add_argument("--compare", action="store_true",
                    help="also draw 1F1B (interleaved with -v > 1, for zb-h1) above the schedule")
    ap.add_argument("--out", default="schedule.png", help="PNG to write")
    args = ap.parse_args(argv)
    if args.p < 1 or args.m < 1 or args.v < 1:
        ap.error("-p, -m and -v must be positive")
    weight_cost = args.backward_cost / 2 if args.weight_cost is None else args.weight_cost
    if not 0 <= weight_cost <= args.backward_cost:
        ap.error("--weight-cost must lie between 0 and --backward-cost")
    if args.v > 1:
        if args.p == 1:
            ap.error("interleaving (-v > 1) needs --pipeline-model-parallel-size > 1")
        try:
            check_interleaved_microbatches(args.m, args.p)
        except ValueError:  # its message names the training flags (--global-batch-size ...), not this tool's
            ap.error(f"the interleaved schedule (-v {args.v}) needs --num-microbatches (-m) {args.m} to be a "
                     f"multiple of --pipeline-model-parallel-size (-p) {args.p}; change -m or drop -v")

    try:
        check_output_file("--out", args.out)
    except ConfigError as err:
        ap.exit(2, f"error: {err}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [(args.v, args.schedule)]
    if args.compare and (args.v > 1 or args.schedule == "zb-h1"):
        variants.insert(0, (args.v if args.schedule == "zb-h1" else 1, "1f1b"))
    drawn = [(schedule(args.p, args.m, v, args.backward_cost, kind, weight_cost), v) for v, kind in variants]
    span = max(e for (timeline, *_), _ in drawn for ops in timeline.values() for _, _, e in ops)
    # 0.45 inch per micro-batch and stage, capped so that the image stays one PIL opens (<= 9600 x 6000 pixels)
    width = min(MAX_INCHES[0], max(8, args.m * args.p * 0.45))
    fig, axes = plt.subplots(len(variants), 1, squeeze=False,
                             figsize=(width, min(MAX_INCHES[1], 1.2 + 0.6 * args.p * len(variants))))
    for ax, ((timeline, bubble, formula, name), v) in zip(axes[:, 0], drawn):
        title = f"{name}: p={args.p}, m={args.m}; bubble {bubble:.4f} (formula {formula:.4f})"
        print(title)
        print(render_grid(timeline, unit=1.0 / v))
        draw(ax, timeline, args.p, args.m, title, label_min_width=0.2 * span / width)  # a label needs ~0.2 inch
    for ax in axes[:, 0]:
        ax.set_xlim(0, span)
    fig.tight_layout()
    try:
        save_figure(fig, args.out, flag="--out")
    except ConfigError as err:  # the write failed after the check (a full disk): nothing left behind
        ap.exit(2, f"error: {err}\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
