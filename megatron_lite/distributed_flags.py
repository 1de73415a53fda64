"""``--distributed-backend``, ``--distributed-timeout-minutes`` and ``--deterministic-mode``: the
checks of the flags (run by :func:`megatron_lite.config_checks.finalize`, exit 2 with one line)
and the deterministic switches a run turns on and gives back.

Megatron-LM's backend default is nccl; here the device decides (nccl on CUDA, gloo on the CPU) and
the flag may only name the backend that fits it: NCCL needs CUDA, and gloo lacks collectives this
package runs on CUDA tensors. ``--deterministic-mode`` (as in Megatron-LM) turns on
``torch.use_deterministic_algorithms`` (an op without a deterministic implementation then raises
instead of running), cuDNN's deterministic kernels without autotuning, and cuBLAS's fixed
workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set); NCCL reductions are deterministic only
with a fixed algorithm, so on CUDA ``NCCL_ALGO`` must name one (Megatron-LM's list).
"""

from __future__ import annotations

import contextlib
import os

import torch

from .device import cuda_wanted
from .errors import ConfigError

BACKENDS = ("nccl", "gloo")
DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def check_distributed_flags(config) -> None:
    p, t = config.parallel, config.training
    if p.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes must be positive, got {p.distributed_timeout_minutes}")
    cuda = cuda_wanted()
    if p.distributed_backend == "nccl" and not cuda:
        raise ConfigError("--distributed-backend nccl needs CUDA and this run is on the CPU (no GPU visible, or "
                          "MEGATRON_LITE_DEVICE=cpu); use --distributed-backend gloo or drop the flag")
    if p.distributed_backend == "gloo" and cuda:
        raise ConfigError("--distributed-backend gloo on CUDA is not supported (gloo lacks collectives this package "
                          "runs on GPU tensors); use nccl, drop the flag, or run on the CPU with MEGATRON_LITE_DEVICE=cpu")
    algo = os.environ.get("NCCL_ALGO")
    if t.deterministic_mode and cuda and algo not in DETERMINISTIC_NCCL_ALGOS:
        raise ConfigError(f"--deterministic-mode on CUDA needs NCCL_ALGO set to one of {', '.join(DETERMINISTIC_NCCL_ALGOS)} "
                          f"(NCCL's reductions are otherwise not reproducible), got {algo or 'unset'}; e.g. NCCL_ALGO=Ring")


@contextlib.contextmanager
def deterministic_mode(enabled: bool):
    """Deterministic algorithms for the body (a no-op when not ``enabled``); the previous settings
    come back afterwards, so a notebook or test process is left as it was."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    if cuda_wanted():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
