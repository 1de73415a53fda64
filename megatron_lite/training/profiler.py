"""``--profile``: Megatron's profiling flags around a window of training iterations.

``--profile --use-pytorch-profiler`` records iterations ``--profile-step-start + 1`` to
``--profile-step-end`` (1-based, i.e. the steps run while the iteration counter goes from start to
end; Megatron's defaults 10 and 12; a run resuming inside the window records from its first iteration,
one resuming after it is refused) on the ranks in ``--profile-ranks`` (default 0) with
``torch.profiler``, then writes a trace that TensorBoard's profiler plugin and Perfetto
(ui.perfetto.dev) open, ``<dir>/rank<r>.<timestamp>.pt.trace.json`` with ``<dir>`` the
``--tensorboard-dir`` (``./profile`` without one), and prints a per-op table (self time, top 25)
and the time per category (GEMM, attention, elementwise, optimizer, copies, communication; see
:mod:`megatron_lite.perf.op_categories`).

Without ``--use-pytorch-profiler`` Megatron drives Nsight Systems: the CUDA profiler API is
started and stopped around the same window (run under ``nsys profile --capture-range=cudaProfilerApi``).
That needs a GPU; on a CPU the flag combination is refused (see :func:`megatron_lite.logging_config.check_profile_flags`).
"""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError
from ..perf.host_memory import minor_page_faults
from ..perf.op_categories import category_breakdown, format_breakdown
from .outputs import DEFAULT_PROFILE_DIR

FAULTS_NOTE = ("each ~1-10 us of kernel time, charged to the operator that first touches a fresh page; the "
               "profiler's own allocations split freed large blocks, so a profiled CPU step faults more than one "
               "without it")


class StepProfiler:
    """Starts and stops the profiler around the configured iterations (call :meth:`before` and
    :meth:`after` around every training iteration, :meth:`close` at the end of the run)."""

    def __init__(self, logging, rank: int, device: torch.device, iteration: int = 0):
        """``iteration``: where the run starts (a resumed run: the checkpoint's). A window it starts inside
        is recorded from there; one wholly before it is refused (nothing would be profiled)."""
        self.enabled = logging.profile and rank in (logging.profile_ranks or [0])
        if logging.profile and logging.profile_step_end <= iteration:
            raise ConfigError(f"--profile: the run resumes at iteration {iteration} and --profile-step-end is "
                              f"{logging.profile_step_end}, so no iteration would be profiled; set "
                              "--profile-step-start and --profile-step-end after the checkpoint's iteration")
        self.start, self.end = max(logging.profile_step_start, iteration), logging.profile_step_end
        self.pytorch = logging.use_pytorch_profiler
        self.folder = logging.tensorboard_dir or DEFAULT_PROFILE_DIR
        self.rank, self.device = rank, device
        self._prof = None
        self._faults = 0
        self._last = self.end  # the last iteration recorded (earlier when the run ends inside the window)
        self.trace_path: str | None = None

    def before(self, iteration: int) -> None:
        """``iteration``: iterations completed so far (the counter before this step)."""
        if not self.enabled or iteration != self.start or self._prof is not None:
            return
        if not self.pytorch:
            torch.cuda.profiler.start()
            self._prof = "nsys"
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._faults = minor_page_faults()
        self._prof.start()

    def after(self, iteration: int) -> None:
        """``iteration``: iterations completed after this step."""
        if self._prof is None:
            return
        self._last = iteration
        if iteration >= self.end:
            self.close()

    def close(self) -> None:
        """Stop a running profile (the run ended inside the window) and report it."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        if prof == "nsys":
            torch.cuda.profiler.stop()
            return
        prof.stop()
        self._faults = minor_page_faults() - self._faults
        os.makedirs(self.folder, exist_ok=True)
        before = set(os.listdir(self.folder))
        torch.profiler.tensorboard_trace_handler(self.folder, worker_name=f"rank{self.rank}")(prof)
        mine = f"rank{self.rank}."  # another rank may write its trace into the folder meanwhile
        written = sorted(name for name in set(os.listdir(self.folder)) - before if name.startswith(mine))
        self.trace_path = os.path.join(self.folder, written[-1]) if written else None
        print(self.report(prof), flush=True)

    def report(self, prof) -> str:
        cuda = self.device.type == "cuda"
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=50)
        events = prof.events()
        parts = [f"> rank {self.rank}: profile of iterations {self.start + 1}-{self._last}, trace {self.trace_path} "
                 "(TensorBoard's profiler plugin or ui.perfetto.dev)", table,
                 format_breakdown(category_breakdown(events), f"rank {self.rank} self CPU time by category")]
        if cuda:
            parts.append(format_breakdown(category_breakdown(events, device=True), f"rank {self.rank} GPU time by category"))
        else:
            parts.append(f"rank {self.rank}: {self._faults} minor page faults in these iterations ({FAULTS_NOTE})")
        return "\n".join(parts)
