"""Where the device and the communication backend are chosen, once.

CPU runs use gloo, CUDA runs use NCCL; nothing else in the package calls ``torch.cuda`` to decide.
Optional accelerators (Transformer Engine, flash-attn, NVIDIA apex) are detected here and reported
in the startup log; none is ever required.
"""

from __future__ import annotations

import datetime
import functools
import gc
import importlib.util
import os

import torch
import torch.distributed as dist

_DEVICE: torch.device | None = None
_OWNS_PROCESS_GROUP = False  # init_distributed made it, so shutdown_distributed ends it
_TIMEOUT: datetime.timedelta | None = None  # --distributed-timeout-minutes of the group init_distributed made


def choose_device(local_rank: int | None = None) -> torch.device:
    """CUDA when available (one GPU per local rank) unless MEGATRON_LITE_DEVICE=cpu; else the CPU."""
    global _DEVICE
    want = os.environ.get("MEGATRON_LITE_DEVICE", "auto").lower()
    if want not in ("auto", "cpu", "cuda"):
        raise ValueError(f"MEGATRON_LITE_DEVICE={want!r}: expected auto, cpu or cuda")
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("MEGATRON_LITE_DEVICE=cuda but no CUDA device is visible")
    if want != "cpu" and torch.cuda.is_available():
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        _DEVICE = torch.device("cuda", torch.cuda.current_device())
    else:
        _DEVICE = torch.device("cpu")
    return _DEVICE


def get_device() -> torch.device:
    """The device chosen by :func:`choose_device` (the CPU if it was never called)."""
    return _DEVICE if _DEVICE is not None else torch.device("cpu")


def empty_unused_memory(wanted: int, level: int) -> None:
    """``--empty-unused-memory-level``: return the CUDA caching allocator's unused blocks to the driver
    (``torch.cuda.empty_cache``) at a point of level ``level`` when the run asked for ``wanted >= level``
    (Megatron-LM's points: 1 after each forward-backward and evaluation step, 2 also after the
    optimizer step). A no-op on the CPU, which has no such cache."""
    if wanted >= level and get_device().type == "cuda":
        torch.cuda.empty_cache()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def cuda_wanted() -> bool:
    """Whether :func:`choose_device` picks CUDA here (a GPU visible and MEGATRON_LITE_DEVICE not cpu)."""
    return os.environ.get("MEGATRON_LITE_DEVICE", "auto").lower() != "cpu" and torch.cuda.is_available()


def process_group_timeout() -> datetime.timedelta | None:
    """The timeout :func:`init_distributed` gave the default group, for the subgroups made later
    (None: the group was made elsewhere, as in the test pool; torch's default then)."""
    return _TIMEOUT


def init_distributed(timeout_minutes: float = 10.0, backend: str | None = None) -> torch.device:
    """Initialise torch.distributed from torchrun's environment (or not at all for one process),
    with ``backend`` (default: nccl on CUDA, gloo on the CPU) and a collective timeout of
    ``timeout_minutes`` (``--distributed-timeout-minutes``; the subgroups get it too).

    Returns the chosen device. A plain ``python script.py`` (no WORLD_SIZE) runs as a single
    process without a process group.
    """
    global _OWNS_PROCESS_GROUP, _TIMEOUT
    device = choose_device()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and not dist.is_initialized():
        _import_dynamo_first()
        _TIMEOUT = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(
            backend=backend or backend_for(device),
            timeout=_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
        _OWNS_PROCESS_GROUP = True
    return device


def _import_dynamo_first() -> None:
    """torch.optim imports torch._dynamo with the first optimizer; imported while a process group
    exists, it keeps references to the default group that nothing releases, and the group outlives
    :func:`shutdown_distributed`. Imported before, it holds none."""
    try:
        import torch._dynamo  # noqa: F401
    except ImportError:  # a torch without it: nothing to import early
        pass


def owns_process_group() -> bool:
    """Whether :func:`init_distributed` made the default group (not so in a test's process pool)."""
    return _OWNS_PROCESS_GROUP and dist.is_initialized()


_AT_SHUTDOWN: list = []


def call_at_shutdown(fn) -> None:
    """Have :func:`shutdown_distributed` call ``fn()`` right after destroying the groups (a module
    holding references to groups, such as parallel/state.py's group cache, drops them there)."""
    _AT_SHUTDOWN.append(fn)


def shutdown_distributed(wait_for_peers: bool = True) -> None:
    """End the process groups :func:`init_distributed` made (nothing if it found one already, as in a
    test's process pool): a barrier (``wait_for_peers``: every rank is past its last collective), then
    every group is destroyed and collected, which joins the communication threads while the
    interpreter is whole.

    Call it last, with no reference to a group left (the run's objects dropped). Left to interpreter
    exit, a gloo worker thread can drop the last reference to a collective's tensor during
    finalisation; freeing it takes the GIL, which a finalising interpreter refuses, and the process
    aborts ("terminate called without an active exception", exit -6) or hangs after a finished run.
    """
    global _OWNS_PROCESS_GROUP, _TIMEOUT
    if not owns_process_group():
        return
    if wait_for_peers:
        dist.barrier()
    dist.destroy_process_group()
    for fn in _AT_SHUTDOWN:  # e.g. the per-process group cache (a pool worker's, whose harness owns the group, is kept)
        fn()
    _OWNS_PROCESS_GROUP, _TIMEOUT = False, None
    gc.collect()  # the subgroups' last references (in reference cycles): their destructors join the threads


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def detect_accelerators() -> dict[str, bool]:
    """Which optional accelerators could be used here (a GPU is required for all of them).

    NVIDIA apex is recognised by its compiled extension, never by the bare name ``apex``: the PyPI
    package called ``apex`` is an unrelated web toolkit.
    """
    gpu = torch.cuda.is_available() and get_device().type == "cuda"
    return {
        "transformer_engine": gpu and _importable("transformer_engine"),
        "flash_attn": gpu and _importable("flash_attn"),
        "apex": gpu and _importable("fused_layer_norm_cuda"),
    }


def describe_backends() -> str:
    """One startup-log line saying which device, backend and accelerators are active."""
    device = get_device()
    found = [name for name, ok in detect_accelerators().items() if ok]
    world = dist.get_world_size() if dist.is_initialized() else 1
    return (
        f"device {device}, backend {backend_for(device) if world > 1 else 'none (1 process)'}, "
        f"world size {world}, attention {'flash-attn' if 'flash_attn' in found else 'torch SDPA'}"
        f"{' (cpu_core_attention with dropout or where it beats SDPA)' if device.type == 'cpu' else ''}, "
        f"optional accelerators: {', '.join(found) if found else 'none (pure PyTorch)'}"
    )


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` (bf16/fp16) in hardware (AVX512-BF16/FP16 or AMX); when
    it does not, 16-bit matmuls are emulated and run several times slower than fp32. Read from the
    Linux CPU flags; False where they cannot be read."""
    wanted = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}.get(dtype, ())
    return any(w in cpu_flags() for w in wanted)


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX matrix units (Linux CPU flags; False where they cannot be read). Cached:
    the core attention asks on every call (models/cpu_attention.beats_cpu_sdpa)."""
    return any(f.startswith("amx") for f in cpu_flags())


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` line of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()
