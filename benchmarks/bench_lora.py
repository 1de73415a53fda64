"""LoRA (rank 8) vs full fine-tuning of the same model in the same run: model-state memory and step time.

A GPT (default: 4 layers, hidden 256, 8 heads, seq 128, vocab 8192, about 5M parameters, fp32,
dropout 0) is saved once as the base; then ``pretrain_gpt.main`` fine-tunes it from
``--pretrained-checkpoint`` twice in this process, one rank: every weight (full), and rank-8 LoRA
adapters on QKV, attention projection, fc1 and fc2 with the base frozen. Per run it reports:

* the model-state bytes the rank holds, measured from the tensors' storages
  (:func:`megatron_lite.perf.model_state.measured_model_state_bytes`: weights, gradient buffer,
  optimizer masters and moments), next to the formula
  (:func:`~megatron_lite.perf.model_state.model_state_bytes_with_frozen`), and the same formula
  for bf16 parameters;
* the median step time of the timed steps (the iteration time the training log prints, after one
  warm-up step) and the ratio LoRA / full.

    python benchmarks/bench_lora.py [--steps 5] [--small]
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402
from megatron_lite.perf.model_state import measured_model_state_bytes, model_state_bytes_with_frozen  # noqa: E402

SHAPES = {
    "default": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
                "--vocab-size", "8192"],
    "small": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--vocab-size", "1024"],
}
RUNS = {"full fine-tuning": [], "LoRA rank 8": ["--lora-rank", "8", "--lora-alpha", "16"]}
STEP = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def _argv(shape: str, steps: int) -> list[str]:
    return SHAPES[shape] + [
        "--mock-data", "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "4", "--global-batch-size", "4",
        "--train-iters", str(steps + 1), "--lr", "1e-4", "--eval-iters", "0", "--log-interval", "1",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1",
    ]


def _run(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = pretrain_gpt.main(argv)
    params = [p for c in result.chunks for p in c.parameters()]
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    total = sum(p.numel() for p in params)
    times = [float(t) / 1000 for t in STEP.findall(out.getvalue())][1:]  # the first step warms up
    return {"total": total, "frozen": frozen, "bytes": measured_model_state_bytes(result.chunks, result.optimizer),
            "step": statistics.median(times), "loss": result.losses[-1]}


def main(argv=None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=5, help="Timed steps per run (after one warm-up step).")
    parser.add_argument("--small", action="store_true", help="A tiny model (a quick check that it runs).")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(describe_machine())
    shape = "small" if args.small else "default"
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain_gpt.main(_argv(shape, 0) + ["--lr", "0", "--save", base])
        results = {name: _run(_argv(shape, args.steps) + ["--pretrained-checkpoint", base] + flags)
                   for name, flags in RUNS.items()}
    full = results["full fine-tuning"]
    full_bytes = sum(full["bytes"].values())
    print(f"\n{full['total']:,} parameters in the base model; {args.steps} timed steps per run, one rank, fp32\n")
    print("| run | trainable params | model state MiB (measured) | formula MiB | bf16 formula MiB | vs full |"
          " step s (median) | step / full |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        trainable, got = r["total"] - r["frozen"], sum(r["bytes"].values())
        formula = model_state_bytes_with_frozen(torch.float32, frozen=r["frozen"], trainable=trainable)[0]
        bf16 = model_state_bytes_with_frozen(torch.bfloat16, frozen=r["frozen"], trainable=trainable)[0]
        print(f"| {name} | {trainable:,} | {got / 2**20:.2f} | {float(formula) / 2**20:.2f} | "
              f"{float(bf16) / 2**20:.2f} | {got / full_bytes:.3f}x | {r['step']:.3f} | {r['step'] / full['step']:.2f} |")


if __name__ == "__main__":
    main()
