"""``--log-progress``: Megatron-LM's ``<save>/progress.txt``, one tab-separated line per event.

Each line is ``<date time>\\tJob ID: <$SLURM_JOB_ID>\\t# GPUs: <world size>\\t<event>``; the events
are ``Starting job`` (at start-up) and, at each checkpoint save, ``Saved checkpoint`` (``Saving
async checkpoint`` with ``--async-save``) followed by ``Iteration: N``, ``Job throughput: X
TFLOP/s/GPU`` (this job's model FLOPs since it started, per second and device), ``Cumulative
throughput: X TFLOP/s/GPU`` (since the first ``Starting job`` of the current run of lines with this
world size, counting from the FLOPs of the checkpoint saved before it), ``Floating-point
operations: X`` (so far, from the consumed samples) and ``Tokens (in billions): X``. Throughputs
below 1 TFLOP/s/GPU get three significant figures instead of Megatron's one decimal. Only global
rank 0 writes; each append rewrites the file through a temporary name.
"""

from __future__ import annotations

import os
import time
from datetime import datetime

import torch.distributed as dist

from ..checkpoint.format import PROGRESS_FILENAME, atomic_write_text

_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _tflops(value: float) -> str:
    """A throughput as Megatron-LM writes it (one decimal) from 1 TFLOP/s on; below that three
    significant figures (a small model on CPU would read 0.0)."""
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.3g}"


class ProgressLog:
    """Appends the progress lines of one run (every method is a no-op without ``--log-progress``)."""

    def __init__(self, config, flops_per_iteration: float, consumed_samples: int):
        on = config.logging.log_progress and (not dist.is_initialized() or dist.get_rank() == 0)
        self.path = os.path.join(config.checkpoint.save, PROGRESS_FILENAME) if on else None
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.flops_per_sample = flops_per_iteration / config.training.global_batch_size
        self.seq_length, self.async_save = config.model.seq_length, config.checkpoint.async_save
        self.start_time, self.start_flops = time.time(), consumed_samples * self.flops_per_sample
        self.append("Starting job")

    def append(self, event: str) -> None:
        if self.path is None:
            return
        old = open(self.path).read() if os.path.exists(self.path) else ""
        line = (f"{datetime.now().strftime(_TIME_FORMAT)}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t"
                f"# GPUs: {self.world_size}\t{event}\n")
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        atomic_write_text(self.path, old + line)

    def saved(self, iteration: int, consumed_samples: int) -> None:
        """The line of a checkpoint saved at ``iteration`` after ``consumed_samples``."""
        if self.path is None:
            return
        flops = consumed_samples * self.flops_per_sample
        job = (flops - self.start_flops) / max(time.time() - self.start_time, 1e-9) / 1e12 / self.world_size
        since, since_flops = self._first_start()
        cumulative = (flops - since_flops) / max((datetime.now() - since).total_seconds(), 1e-9) / 1e12 / self.world_size
        prefix = "Saving async checkpoint" if self.async_save else "Saved checkpoint"
        self.append(f"{prefix}\tIteration: {iteration}\tJob throughput: {_tflops(job)} TFLOP/s/GPU\t"
                    f"Cumulative throughput: {_tflops(cumulative)} TFLOP/s/GPU\tFloating-point operations: {flops:.2e}\t"
                    f"Tokens (in billions): {consumed_samples * self.seq_length / 1e9:.2f}")

    def _first_start(self) -> tuple[datetime, float]:
        """Time of the first 'Starting job' since the world size last changed, and the floating-point
        operations of the checkpoint saved before it (0 if none)."""
        start, start_flops, latest_flops = None, 0.0, 0.0
        with open(self.path) as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                if len(fields) >= 8 and fields[3].startswith(("Saved checkpoint", "Saving async checkpoint")):
                    latest_flops = float(fields[7].split(": ")[1])
                if len(fields) < 4 or fields[2] != f"# GPUs: {self.world_size}":
                    start = None  # another world size: count from its next start
                elif fields[3] == "Starting job" and start is None:
                    start, start_flops = datetime.strptime(fields[0], _TIME_FORMAT), latest_flops
        return start or datetime.fromtimestamp(self.start_time), start_flops
