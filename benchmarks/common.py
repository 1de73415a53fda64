"""Helpers shared by the benchmarks: a description of the machine, timing, table printing, and the
command line's parser (a bad flag: one line naming it, exit code 2, as the project's tools)."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from megatron_lite.errors import OneLineParser as OneLineParser  # the benchmarks' parser


def positive_int(text: str) -> int:
    """An argparse type for counts (rounds, steps, repeats, threads): a bad one is refused in one line
    naming the flag, not a traceback after the machine was described (``median`` of no rounds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (at least 1)")
    return value


def add_inference_model_args(p, rounds: int) -> None:
    """The inference benchmarks' shared flags: timed rounds, threads and the random GPT they serve."""
    p.add_argument("--rounds", type=positive_int, default=rounds)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--vocab", type=positive_int, default=8192)


def positive_float(text: str) -> float:
    """An argparse type for sizes, peaks and timeouts: above 0, or refused in one line naming the flag."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def probability(text: str) -> float:
    """An argparse type for dropout rates: in [0, 1), or refused in one line naming the flag."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a probability in [0, 1)")
    return value


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(threads: int | None = None) -> str:
    """One paragraph: CPU model, cores, memory, torch version and threads, GPU if any."""
    lines = [
        f"cpu: {cpu_model()}, {os.cpu_count()} logical cores visible"
        + (f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""),
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"threads {threads if threads is not None else torch.get_num_threads()}",
    ]
    try:
        with open("/proc/meminfo") as f:
            total_kib = int(f.readline().split()[1])
        lines.append(f"memory: {total_kib / 2**20:.1f} GiB")
    except (OSError, ValueError, IndexError):
        pass
    if torch.cuda.is_available():
        lines.append(f"gpu: {torch.cuda.get_device_name()} visible")
    return "\n".join(lines)


def times_less(before: float, after: float, less: str, more: str) -> str:
    """``before / after`` as ``"2.09x shorter"``, or, when ``after`` is the larger, ``"1.85x longer"``
    (not ``"0.54x shorter"``)."""
    if after > before:
        return f"{after / before:.2f}x {more}"
    return f"{before / after:.2f}x {less}"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summarize(times: list[float]) -> str:
    """``median m s (min a, max b, n=k)``."""
    return f"median {statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f}, n={len(times)})"
