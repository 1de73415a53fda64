"""Console lines and TensorBoard scalars in Megatron-LM's format, so existing log parsers keep working.

One line every ``--log-interval`` iterations, printed by one rank of the last pipeline stage (the
only stage that has the loss): tensor-parallel rank 0, data-parallel rank 0. Fields and order are
Megatron's; ours are appended after them::

     [2026-11-21 20:01:02] iteration       20/     100 | consumed samples:          320 |
     elapsed time per iteration (ms): 812.3 | throughput per GPU (TFLOP/s/GPU): 0.1 |
     learning rate: 3.000000E-04 | global batch size:    16 | lm loss: 6.912345E+00 |
     loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |
     number of nan iterations:   0 | tokens per second per device: 1234.5 | peak memory (MB): 812.0 |

(one line in reality). The throughput field appears with ``--log-throughput``, as in Megatron.
Losses are averaged over the non-skipped iterations since the previous line; the iteration time is
averaged over all of them. Peak memory is ``torch.cuda.max_memory_allocated`` on a GPU and the
process's peak resident set size (``getrusage``) on the CPU.

TensorBoard (``--tensorboard-dir``, logging rank only) gets Megatron's scalar names: ``lm loss``,
``learning-rate``, ``grad-norm``, ``loss-scale``, ``params-norm``, ``num-zeros`` (and with their
flags ``batch-size``, ``world-size`` and the memory scalars) every ``--tensorboard-log-interval``
iterations; ``iteration-time``, ``throughput``, ``tokens-per-second-per-device`` and the memory figure
(``mem-max-allocated-bytes`` on GPU, ``mem-max-rss-bytes`` on CPU) every log interval;
``lm loss validation`` (and ``lm loss validation ppl`` with ``--log-validation-ppl-to-tensorboard``)
at each evaluation. With ``--wandb-project``
the same scalars also go to Weights & Biases (see :mod:`megatron_lite.training.writers`).
"""

from __future__ import annotations

import math
import sys
from datetime import datetime

import torch

from ..console import is_logging_rank
from ..device import get_device
from ..perf.numbers import figure
from .timers import format_timers
from .writers import build_writer, check_wandb_available


def peak_memory_bytes() -> tuple[str, int]:
    """(TensorBoard name, bytes) of this process's peak memory on the active device."""
    if get_device().type == "cuda":
        return "mem-max-allocated-bytes", int(torch.cuda.max_memory_allocated())
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return "mem-max-rss-bytes", int(rss if sys.platform == "darwin" else rss * 1024)


# scalars written only when their flag is on (Megatron-LM's defaults: learning rate and loss scale on)
_SCALAR_FLAGS = {"learning-rate": "log_learning_rate_to_tensorboard", "batch-size": "log_batch_size_to_tensorboard",
                 "loss-scale": "log_loss_scale_to_tensorboard", "world-size": "log_world_size_to_tensorboard"}


def tensorboard_wants(logging, name: str) -> bool:
    """Whether the per-iteration scalar ``name`` goes to TensorBoard / W&B under these flags."""
    flag = _SCALAR_FLAGS.get(name)
    return flag is None or getattr(logging, flag)


def memory_scalars(logging) -> dict[str, int]:
    """--log-memory-to-tensorboard: the allocator's figures on a GPU (Megatron-LM's four names), the
    process's current and peak resident set size on the CPU; {} without the flag."""
    if not logging.log_memory_to_tensorboard:
        return {}
    if get_device().type == "cuda":
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    import os

    with open("/proc/self/statm") as f:  # pages: size, resident, ...
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"mem-rss-bytes": resident, "mem-max-rss-bytes": peak_memory_bytes()[1]}


def _is_nan_or_inf(value: float) -> bool:
    return math.isnan(value) or math.isinf(value)


class TrainLogger:
    """Accumulates per-iteration figures and prints Megatron's line every ``--log-interval`` iterations.

    ``flops_per_iteration`` is the model FLOPs of one global batch (see
    :func:`megatron_lite.perf.flops.num_floating_point_operations`); the TFLOP/s figure divides it by
    the world size. Pass losses already averaged over data-parallel ranks. ``consumed_samples``
    counts from ``start_consumed_samples`` (set it after resuming) unless the loop passes its own.
    """

    def __init__(self, config, state, flops_per_iteration: float, start_consumed_samples: int = 0,
                 writer=None):
        self.config = config
        self.state = state
        self.flops_per_iteration = float(flops_per_iteration)
        self.log_interval = config.logging.log_interval
        self.train_iters = config.training.train_iters
        self.seq_length = config.model.seq_length
        self.log_throughput = config.logging.log_throughput
        self.world_size = max(1, state.world_size)
        self.consumed_samples = int(start_consumed_samples)
        self._last_batch = 0
        self.enabled = is_logging_rank(state)
        self.writer = writer
        check_wandb_available(config)
        if self.writer is None and self.enabled:  # TensorBoard and/or W&B, the same scalars to each
            self.writer = build_writer(config)
        self._reset_interval()

    def _reset_interval(self) -> None:
        self._loss_sums: dict[str, float] = {}
        self._advanced = 0
        self._iters = 0
        self._skipped = 0
        self._nan = 0
        self._time = 0.0
        self._samples = 0

    # -----------------------------------------------------------------------------------------
    def log_iteration(self, iteration: int, losses: dict, lr: float, grad_norm, loss_scale: float,
                      skipped: bool, nan: bool, iter_time_s: float, batch_size: int, *,
                      consumed_samples: int | None = None, params_norm: float | None = None,
                      num_zeros: int | None = None, extra_scalars: dict | None = None) -> str | None:
        """Record one iteration; on a multiple of ``--log-interval`` print and return the line.
        ``extra_scalars`` go to TensorBoard only (e.g. ``moe/load_balancing_loss_layer_1``)."""
        losses = {k: float(v) for k, v in losses.items()}
        if consumed_samples is None:
            self.consumed_samples += int(batch_size)
        else:
            self.consumed_samples = int(consumed_samples)
        self._iters += 1
        self._time += float(iter_time_s)
        self._samples += int(batch_size)
        self._last_batch = int(batch_size)  # the line shows the last step's (--rampup-batch-size changes it)
        if skipped:
            self._skipped += 1
        else:
            self._advanced += 1
            for key, value in losses.items():
                self._loss_sums[key] = self._loss_sums.get(key, 0.0) + value
        if nan or any(_is_nan_or_inf(v) for v in losses.values()):
            self._nan += 1

        if self.writer is not None and self.enabled and iteration % self.config.logging.tensorboard_log_interval == 0:
            scalars = {"learning-rate": lr, "batch-size": batch_size, **losses, "loss-scale": loss_scale,
                       "world-size": self.world_size, "grad-norm": grad_norm, "num-zeros": num_zeros,
                       "params-norm": params_norm, **(extra_scalars or {}), **memory_scalars(self.config.logging)}
            for key, value in scalars.items():
                if value is not None and tensorboard_wants(self.config.logging, key):
                    self.writer.add_scalar(key, value, iteration)

        if iteration % self.log_interval != 0:
            return None
        line = self._line(iteration, lr, grad_norm, loss_scale, params_norm, num_zeros)
        self._reset_interval()
        return line

    def _line(self, iteration, lr, grad_norm, loss_scale, params_norm, num_zeros) -> str | None:
        per_iter = self._time / max(1, self._iters)
        tokens_per_s = self._samples * self.seq_length / max(self._time, 1e-12) / self.world_size
        # flops_per_iteration is a full global batch's; a ramped-up (smaller) batch does its share of them
        full = self._iters * (self.config.training.global_batch_size or self._samples // max(1, self._iters))
        tflops = self.flops_per_iteration * (self._samples / max(full, 1)) / max(per_iter, 1e-12) / 1e12 / self.world_size
        mem_name, mem_bytes = peak_memory_bytes()
        if self.writer is not None and self.enabled:
            self.writer.add_scalar("iteration-time", per_iter, iteration)
            self.writer.add_scalar("throughput", tflops, iteration)
            self.writer.add_scalar("tokens-per-second-per-device", tokens_per_s, iteration)
            self.writer.add_scalar(mem_name, mem_bytes, iteration)
            self.writer.flush()
        if not self.enabled:
            return None
        parts = [
            f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]",
            f" iteration {iteration:8d}/{self.train_iters:8d} |",
            f" consumed samples: {self.consumed_samples:12d} |",
            f" elapsed time per iteration (ms): {per_iter * 1000.0:.1f} |",
        ]
        if self.log_throughput:
            parts.append(f" throughput per GPU (TFLOP/s/GPU): {figure(tflops)} |")
        parts.append(f" learning rate: {lr:.6E} |")
        parts.append(f" global batch size: {self._last_batch:5d} |")
        for key, total in self._loss_sums.items():
            parts.append(f" {key}: {total / max(1, self._advanced):.6E} |")
        parts.append(f" loss scale: {loss_scale:.1f} |")
        if grad_norm is not None:
            parts.append(f" grad norm: {grad_norm:.3f} |")
        if num_zeros is not None:
            parts.append(f" num zeros: {num_zeros:.1f} |")
        if params_norm is not None:
            parts.append(f" params norm: {params_norm:.3f} |")
        parts.append(f" number of skipped iterations: {self._skipped:3d} |")
        parts.append(f" number of nan iterations: {self._nan:3d} |")
        parts.append(f" tokens per second per device: {tokens_per_s:.1f} |")
        parts.append(f" peak memory (MB): {mem_bytes / 2**20:.1f} |")
        line = "".join(parts)
        print(line, flush=True)
        return line

    def log_timers(self, iteration: int, times: dict[str, float]) -> str | None:
        """Print the per-phase timers (ms per iteration) and, with --log-timers-to-tensorboard, write them."""
        if not self.enabled:
            return None
        if self.writer is not None and self.config.logging.log_timers_to_tensorboard:
            for name, ms in times.items():
                self.writer.add_scalar(f"{name}-time", ms, iteration)
        line = format_timers(times)
        print(line, flush=True)
        return line

    # -----------------------------------------------------------------------------------------
    def log_validation(self, iteration: int, losses: dict, prefix: str | None = None, name: str | None = None,
                       scalars: bool = True) -> str | None:
        """Print Megatron's validation block (loss and perplexity per loss name) and log to TensorBoard;
        ``name``: one of --multiple-validation-sets (scalars ``<loss> validation <name>``); ``scalars``
        False (the test split's pass) prints only."""
        losses = {k: float(v) for k, v in losses.items()}
        suffix = "" if name is None else f" {name}"
        if self.writer is not None and self.enabled and scalars:
            for key, value in losses.items():
                self.writer.add_scalar(f"{key} validation{suffix}", value, iteration)
                if self.config.logging.log_validation_ppl_to_tensorboard:
                    self.writer.add_scalar(f"{key} validation{suffix} ppl", math.exp(min(20.0, value)), iteration)
            self.writer.flush()
        if not self.enabled:
            return None
        where = prefix if prefix is not None else f"iteration {iteration}"
        where += "" if name is None else f" on validation set {name}"
        line = f" validation loss at {where} |"
        for key, value in losses.items():
            line += f" {key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E} |"
        rule = "-" * (len(line) + 1)
        print(f"{rule}\n{line}\n{rule}", flush=True)
        return line

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
