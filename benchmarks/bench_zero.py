"""Sharded data parallelism at DP 4 on CPU: peak memory, model-state bytes and step time per strategy.

Every strategy trains the same GPT (default: 8 layers, hidden 640, 10 heads, seq 128, vocab 32768,
about 60M parameters, fp32, dropout 0) through ``pretrain_gpt.main`` on 4 freshly spawned CPU
processes (gloo, one thread each), global batch 4 (micro-batch 1 per rank). Per strategy it reports:

* the peak resident memory of each rank during the timed steps (the high-water mark is reset
  after the two tracked steps through ``/proc/self/clear_refs``, after ``malloc_trim`` gave freed heap
  back, so model building and memory the allocator merely keeps do not count;
  ``ru_maxrss`` of the whole run where that file is not writable): weights, gradients, optimizer
  state, activations, communication buffers and the Python/torch baseline, which is printed too
  (the resident memory just before ``pretrain_gpt.main``). On a CPU-only machine "device" and host
  memory are the same RAM, so offload cannot lower it: it moves state, and adds a gradient copy;
* the model-state bytes rank 0 holds, measured from the tensors' storages
  (:func:`megatron_lite.perf.model_state.measured_model_state_bytes`), device and CPU parts;
* the peak live tensor bytes per rank (``--memory-report``'s tracker, which counts tensors, not
  what the allocator or gloo keep) in the second step, when Adam's moments exist all step: the
  highest over the ranks, its ratio to no_shard's, and its breakdown by category (parameters,
  gradients, optimizer state, activations, communication buffers, temporaries) with the operator
  and phase it was reached at;
* the median step time (barrier to barrier) after the two tracked steps, and its ratio to no_shard.

Strategies whose flags this build refuses (the flag check exits with code 2) are reported "not
available" instead of run. Each strategy runs in fresh processes, so peak memory is its own.

    python benchmarks/bench_zero.py [--steps 3] [--small] [--only no_shard,optim]
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import resource
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402
from megatron_lite.perf.memory_tracker import CATEGORIES  # noqa: E402

WORLD = 4
TRACKED = 2  # --memory-report's steps (slower: not timed)
SHAPES = {
    "mid": ["--num-layers", "8", "--hidden-size", "640", "--num-attention-heads", "10", "--seq-length", "128",
            "--vocab-size", "32768"],
    "small": ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
              "--vocab-size", "4096"],
}
DISTOPT = ["--use-distributed-optimizer"]
STRATEGIES = {  # name: flags
    "no_shard": [],
    "optim (ZeRO-1)": DISTOPT,
    "optim_grads (ZeRO-2)": ["--data-parallel-sharding-strategy", "optim_grads"],
    "optim_grads_params (ZeRO-3)": ["--data-parallel-sharding-strategy", "optim_grads_params"],
    "hybrid: optim, 2 instances": DISTOPT + ["--num-distributed-optimizer-instances", "2"],
    "optim + CPU offload 1.0": DISTOPT + ["--optimizer-cpu-offload"],
    "optim + CPU offload 0.5": DISTOPT + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"],
}


def _argv(shape: str, flags: list[str], steps: int, bucket: int | None = None) -> list[str]:
    return SHAPES[shape] + (["--ddp-bucket-size", str(bucket)] if bucket else []) + [
        "--mock-data", "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "1", "--global-batch-size",
        str(WORLD), "--train-iters", str(steps + TRACKED), "--memory-report", "--lr", "1e-4", "--lr-warmup-iters", "0", "--eval-iters", "0",
        "--log-interval", "1000", "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1",
    ] + flags


def _refusal(argv: list[str]) -> str | None:
    """The one-line refusal of these flags at world size 4, or None when they are accepted."""
    from megatron_lite.arguments import parse_args

    err = io.StringIO()
    os.environ["WORLD_SIZE"] = str(WORLD)
    try:
        with contextlib.redirect_stderr(err):
            parse_args(argv)
    except SystemExit as exit_:
        if exit_.code:
            lines = err.getvalue().strip().splitlines()
            return lines[-1].split("error: ", 1)[-1] if lines else f"exit {exit_.code}"
    finally:
        os.environ.pop("WORLD_SIZE", None)
    return None


def _worker(rank, port, argv, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), MEGATRON_LITE_DEVICE="cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import megatron_lite.training.loop as loop
    import pretrain_gpt
    from megatron_lite.perf.model_state import measured_model_state_bytes

    times, step = [], loop.train_step
    baseline_mib = _status_kib("VmRSS") / 1024

    def timed_step(*args, **kwargs):  # barrier to barrier, so the slowest rank sets the time
        if len(times) == TRACKED:  # after the tracked steps: from here on the peak of training alone
            _reset_peak()
        dist.barrier()
        start = time.perf_counter()
        out = step(*args, **kwargs)
        dist.barrier()
        times.append(time.perf_counter() - start)
        return out

    loop.train_step = timed_step
    with contextlib.redirect_stdout(io.StringIO()):
        result = pretrain_gpt.main(argv)
    n = sum(p.numel() for c in result.chunks for p in c.parameters())
    measured = measured_model_state_bytes(result.chunks, result.optimizer)
    peak_mib = _status_kib("VmHWM") / 1024 if _PEAK_RESET else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (live_peak,) = result.memory[-1]["peak"].values()  # the second step's
    results.put((rank, n, measured, peak_mib, times[TRACKED:], result.losses[-1] if result.losses else None,
                 baseline_mib, live_peak))


_PEAK_RESET = []  # non-empty once this process reset its high-water mark


def _status_kib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return float(line.split()[1])
    return float("nan")


def _reset_peak() -> None:
    """Return freed heap to the OS (glibc keeps it otherwise), then restart the high-water mark."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _PEAK_RESET.append(True)
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _guarded_worker(rank, port, argv, results):
    try:
        _worker(rank, port, argv, results)
    except BaseException as err:  # the parent restarts a run whose port was taken meanwhile
        results.put((rank, "failed", f"{type(err).__name__}: {err}"))
        raise


def run_strategy(argv: list[str], attempts: int = 3) -> list[tuple]:
    """Every rank's result, in rank order; a run whose free port was taken before rank 0 bound it is
    restarted on another port."""
    ctx = mp.get_context("spawn")
    for attempt in range(attempts):
        results = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_guarded_worker, args=(rank, port, argv, results)) for rank in range(WORLD)]
        for p in procs:
            p.start()
        out = []
        while len(out) < WORLD and not any(r[1] == "failed" for r in out):
            out.append(results.get())
        failed = [r for r in out if r[1] == "failed"]
        for p in procs:
            if failed:
                p.terminate()
            p.join()
        if not failed:
            return sorted(out)
        if "EADDRINUSE" not in failed[0][2] or attempt == attempts - 1:
            raise RuntimeError(f"rank {failed[0][0]} failed: {failed[0][2]}")
    raise AssertionError("unreachable")


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=3, help=f"timed steps per strategy (after {TRACKED} tracked ones)")
    parser.add_argument("--small", action="store_true", help="a tiny model (a smoke test of the script)")
    parser.add_argument("--ddp-bucket-size", type=positive_int, default=None,
                        help="gradient bucket size in elements (default: the training default, max(40M, 1M x dp))")
    parser.add_argument("--only", default=None, help="comma-separated prefixes of the strategy names to run")
    args = parser.parse_args()
    unmatched = [p for p in (args.only or "").split(",") if args.only and not any(n.startswith(p) for n in STRATEGIES)]
    if unmatched:
        parser.error(f"--only {','.join(unmatched)}: no strategy name starts with it (the names: "
                     f"{', '.join(STRATEGIES)})")
    shape = "small" if args.small else "mid"
    print(describe_machine(threads=1))
    print(f"DP {WORLD} CPU processes (gloo, 1 thread each), shape {shape}: {' '.join(SHAPES[shape])}, fp32, "
          f"global batch {WORLD}, {args.steps} timed steps after {TRACKED} tracked ones, ddp bucket size "
          f"{args.ddp_bucket_size or 'default'}\n")
    rows, live_rows, base, live_base = [], [], None, None
    for name, flags in STRATEGIES.items():
        if args.only and not any(name.startswith(p) for p in args.only.split(",")):
            continue
        argv = _argv(shape, flags, args.steps, args.ddp_bucket_size)
        refused = _refusal(argv)
        if refused is not None:
            rows.append(f"| {name} | not available ({refused}) | | | | |")
            print(rows[-1], flush=True)
            continue
        ranks = run_strategy(argv)
        rank, n, measured, _, times, loss, baseline, _ = ranks[0]
        step = statistics.median(times)
        base = step if name == "no_shard" else base
        live = max((r[7] for r in ranks), key=lambda snap: snap.total)
        live_base = live.total if name == "no_shard" else live_base
        live_rows.append(_live_row(name, live, live_base))
        device = measured["params"] + measured["grads"] + measured["optimizer"]
        peaks = [r[3] for r in ranks]
        ratio = f"{step / base:.2f}" if base else "n/a"
        rows.append(f"| {name} | {max(peaks):.0f} (min {min(peaks):.0f}) | {device / 2**20:.0f} + CPU "
                    f"{measured['optimizer_cpu'] / 2**20:.0f} | {device / n:.2f} + {measured['optimizer_cpu'] / n:.2f} "
                    f"| {step:.2f} | {ratio} |")
        print(rows[-1] + f"   ({n:,} params per rank, last loss {loss:.4f}, rank 0 baseline RSS {baseline:.0f} MiB, "
              f"load average {os.getloadavg()[0]:.1f})\n" + live_rows[-1], flush=True)
    print("\n| strategy | peak RSS per rank in the timed steps, MiB (max, min) | model state rank 0, MiB (device + CPU) "
          "| bytes/param (device + CPU) | step s (median) | step / no_shard |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| strategy | peak live tensor bytes per rank, MiB (max over ranks) | / no_shard | "
          + " | ".join(CATEGORIES) + " | reached at |")
    print("|---|---|---|" + "---|" * len(CATEGORIES) + "---|")
    print("\n".join(live_rows))


def _live_row(name: str, live, base: int | None) -> str:
    ratio = f"{live.total / base:.2f}" if base else "n/a"
    parts = " | ".join(f"{live.bytes[c] / 2**20:.1f}" for c in CATEGORIES)
    return f"| {name} | {live.total / 2**20:.1f} | {ratio} | {parts} | {live.where} |"


if __name__ == "__main__":
    main()
