"""The CUDA path against the CPU: the same training runs on both devices, compared step by step.

Each run is ``pretrain_gpt.main`` on the tests' tiny models (8 steps, 4 micro-batches per step, no
dropout, mock data): the models are initialised on the CPU and moved, so both devices start from the
same weights, and each step's losses and gradient norm must agree within the run's tolerance
(fp32: rel 1e-4, for cuBLAS's and the CPU's different summation orders over 8 Adam steps; bf16 and
FP8: rel 3e-2, whose rounding differs between the devices' kernels). The runs cover the GPU-only
kernels: SDPA's flash/efficient attention, the grouped expert GEMM (``torch._grouped_mm``, bf16),
FP8 through ``torch._scaled_mm`` (the CPU computes the same products as dequantised GEMMs), fused
AdamW, Inductor's Triton kernels for the fusions and ``--torch-compile``.

    python benchmarks/cuda_checks.py [--only gpt moe_bf16 ...]   # on a machine with a GPU

Each device runs in its own process (the device is chosen once per process); exit 1 when a run
differs. Not part of the test suite: CI has no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import OneLineParser  # noqa: E402

FP32, LOW = (1e-4, 1e-4), (3e-2, 1e-1)  # (losses, gradient norms)


def configs() -> dict[str, tuple[list[str], tuple[float, float]]]:
    """name -> (flags added to the tests' tiny GPT, relative tolerances of losses and gradient norms)."""
    from tests.e2e.test_pretrain_deepseek import VARIANTS
    from tests.e2e.test_pretrain_gpt import MODEL_B
    from tests.e2e.test_pretrain_moe import MOE, MOE_B

    bf16, fp8 = ["--bf16"], ["--bf16", "--fp8-format", "hybrid"]
    return {
        "gpt": ([], FP32),
        "gpt_b": (MODEL_B, FP32),
        "gpt_b_bf16": (MODEL_B + bf16, LOW),
        "gpt_b_compile": (MODEL_B + ["--torch-compile"], FP32),
        "moe": (MOE + MOE_B, FP32),
        "moe_bf16": (MOE + MOE_B + bf16, LOW),  # the grouped GEMM's CUDA kernel
        "deepseek": (VARIANTS["dsv3"], FP32),
        "fp8": (MODEL_B + fp8, LOW),
        "fp8_moe": (MOE + fp8, LOW),
    }


def run_all(names: list[str], out: str) -> None:
    """In this process (one device): each config's trajectory, written to ``out`` as JSON."""
    from tests.e2e.test_pretrain_gpt import _argv
    from tests.trajectory import run_script

    results = {}
    for name in names:
        flags, _ = configs()[name]
        with tempfile.TemporaryDirectory() as save:
            try:
                t = run_script("pretrain_gpt", _argv(save, 8, flags))
                results[name] = {"losses": t.losses, "grad_norms": t.grad_norms, "reported": t.reported}
            except Exception as err:  # noqa: BLE001 - reported per config, the others still run
                results[name] = {"error": f"{type(err).__name__}: {err}"}
        print(f"{name}: {'error' if 'error' in results[name] else 'ran'}", flush=True)
    with open(out, "w") as f:
        json.dump(results, f)


def worst(a: dict, b: dict, tolerances: tuple[float, float]) -> tuple[float, str]:
    """The largest relative difference of two trajectories as a fraction of its tolerance (losses and
    gradient norms each against their own), and where it is."""
    loss_tol, grad_tol = tolerances
    pairs = [(x, y, loss_tol, f"loss at step {i}") for i, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True), 1)]
    pairs += [(x, y, grad_tol, f"grad norm at step {i}")
              for i, (x, y) in enumerate(zip(a["grad_norms"], b["grad_norms"], strict=True), 1)]
    for i, (ra, rb) in enumerate(zip(a["reported"], b["reported"], strict=True), 1):
        pairs += [(ra[k], rb[k], loss_tol, f"{k} at step {i}") for k in rb]
    return max((abs(x - y) / max(abs(y), 1e-12) / tol, where) for x, y, tol, where in pairs)


def compare(names: list[str], cuda: dict, cpu: dict) -> bool:
    ok = True
    for name in names:
        tolerances = configs()[name][1]
        if "error" in cuda[name] or "error" in cpu[name]:
            print(f"| {name} | error | cuda: {cuda[name].get('error', 'ran')}; cpu: {cpu[name].get('error', 'ran')} |")
            ok = False
            continue
        share, where = worst(cuda[name], cpu[name], tolerances)
        good = share <= 1 and len(cuda[name]["losses"]) == len(cpu[name]["losses"]) == 8
        ok &= good
        print(f"| {name} | {'ok' if good else 'DIFFERS'} | worst: {where}, {share:.2f} of its tolerance "
              f"(losses {tolerances[0]:g}, grad norms {tolerances[1]:g}); "
              f"cuda losses {cuda[name]['losses'][0]:.4f} -> {cuda[name]['losses'][-1]:.4f} |", flush=True)
    return ok


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", help="these configs (default: all)")
    p.add_argument("--device", choices=["cpu", "cuda"], help=argparse.SUPPRESS)  # a worker process
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--devices", nargs=2, default=["cuda", "cpu"], help=argparse.SUPPRESS)  # cpu cpu: try it here
    args = p.parse_args(argv)
    names = args.only or list(configs())
    unknown = [n for n in names if n not in configs()]
    if unknown:
        p.error(f"--only {' '.join(unknown)}: no such config (the configs: {', '.join(configs())})")
    if args.device:
        run_all(names, args.out)
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side, device in zip(("cuda", "cpu"), args.devices, strict=True):
            out = os.path.join(tmp, f"{side}.json")
            env = dict(os.environ, MEGATRON_LITE_DEVICE=device, PYTHONPATH=ROOT)
            subprocess.run([sys.executable, __file__, "--device", device, "--out", out, "--only", *names],
                           env=env, check=True)
            with open(out) as f:
                results[side] = json.load(f)
    print("\n| run | cuda vs cpu | |\n|---|---|---|")
    return 0 if compare(names, results["cuda"], results["cpu"]) else 1


if __name__ == "__main__":
    sys.exit(main())
