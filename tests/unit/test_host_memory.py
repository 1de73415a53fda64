"""--retain-host-memory: after start-up, a large tensor allocated and freed again and again stops
page-faulting (the pages stay in the process); without it, every allocation faults its pages in.

Each case runs in a new process: the setting is process-wide and lasting."""

import resource

import pytest
import torch

from megatron_lite.perf.host_memory import _glibc_mallopt, minor_page_faults
from tests.harness import run_in_new_process

MIB_64 = 64 * 2**20
PAGES = MIB_64 // resource.getpagesize()


def _faults_per_allocation(use_setup: bool, flags: list[str]) -> None:
    """Print the minor page faults of one 64 MiB allocation, filled then freed, averaged over the
    last 5 of 20 (glibc's per-size caches of small alignment remainders fill in the first few).
    Transparent huge pages are off for this process, so a fault is one 4 KiB page on any machine."""
    import ctypes

    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
    if use_setup:
        from megatron_lite.arguments import parse_args
        from megatron_lite.training.startup import setup

        setup(parse_args(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1", "--seq-length", "8",
                          "--max-position-embeddings", "8", "--micro-batch-size", "1", "--vocab-size", "16",
                          "--train-iters", "1", "--mock-data", *flags], world_size=1))
    faults = []
    for _ in range(20):
        before = minor_page_faults()
        x = torch.empty(MIB_64, dtype=torch.uint8)
        x.fill_(1)
        del x
        faults.append(minor_page_faults() - before)
    print(sum(faults[-5:]) / 5)


def _measure(use_setup: bool, flags: list[str]) -> float:
    code, out, err = run_in_new_process(_faults_per_allocation, use_setup, flags, env={"MEGATRON_LITE_DEVICE": "cpu"})
    assert code == 0, err
    return float(out.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc_mallopt() is None, reason="glibc's mallopt only")
def test_retained_host_memory_stops_page_faults():
    assert _measure(False, []) > 0.5 * PAGES  # the default C library: every allocation faults its pages in
    assert _measure(True, []) < 0.02 * PAGES  # setup() on a CPU run keeps the freed pages
    assert _measure(True, ["--no-retain-host-memory"]) > 0.5 * PAGES  # the flag leaves glibc as it is
