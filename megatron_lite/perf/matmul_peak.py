"""This machine's dense matmul peak (the denominator of a measured MFU; the FP8 GEMM path's CPU probe).

Kept apart from :mod:`.flops` so that the precision layer can time a GEMM without importing the
model package, which the FLOPs count reads its per-layer sliding windows from."""

from __future__ import annotations

import time

import torch


def measure_matmul_peak(n: int = 2048, dtype=torch.float32, device=None, warmup: int = 3, reps: int = 10) -> float:
    """This machine's dense matmul FLOP/s: the best of ``reps`` timed ``a @ b`` of n x n matrices.

    Uses the current torch thread count, so set it to what the benchmark uses. On CUDA the device
    is synchronised around each product.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        a @ b
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best
