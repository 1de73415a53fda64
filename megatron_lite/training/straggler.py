"""The straggler detector (``--log-straggler``): which ranks compute slowest, every log interval.

On a large job one slow GPU or node paces every step, and the log line's iteration time cannot say
which. With ``--log-straggler`` each rank times its own compute: the forward and backward of every
micro-batch (and, on the zero-bubble schedule, the deferred weight-gradient passes), as the pipeline
schedule runs them (:class:`~megatron_lite.parallel.pipeline.trace.Trace`). That time includes
reading the micro-batch from the data iterator and the tensor- and context-parallel collectives
inside the layers, but not the pipeline's sends and receives between the ops, the data-parallel
gradient reduction finalised after them, nor the optimizer step: a rank waiting for a slow peer at a
pipeline boundary or in the gradient all-reduce does not look slow itself. On a GPU the clock
synchronises the device at each op's start and end (so it measures the kernels, not their launch),
which costs the overlap across ops; the detector off times nothing.

Every ``--log-interval`` iterations all ranks gather one small row each (compute seconds,
iterations, FLOPs, TP/PP/DP/CP coordinates) and global rank 0 prints one line::

     straggler | iteration 20 | compute time per iteration max/min: 1.82 | slowest 1: rank 1 (tp 0 pp 0 dp 1)
     120.3 ms 0.52 TFLOP/s | fastest 1: rank 0 (tp 0 pp 0 dp 0) 66.1 ms 0.95 TFLOP/s |

(one line in reality). TFLOP/s is this rank's share of the model FLOPs of the interval's batches
(:func:`megatron_lite.perf.flops.num_floating_point_operations` over the world size, as the log line's
throughput) over its compute time, so it exceeds the log line's figure, which divides by the whole
iteration time. Pipeline stages do different work (the embedding, the loss): compare ranks of one stage.

``--straggler-ctrlr-port``: rank 0 serves HTTP on that port (all interfaces) from a daemon thread; any
GET switches the detector on or off. Every rank learns the switch at the next report: a detector
that is on sends it in the gathered rows, one that is off broadcasts it from rank 0 (one tiny
collective per log interval, the only cost of a detector switched off). ``--disable-straggler-on-startup``
starts it off. A port already in use stops the run before the first step (one line, exit 2).
"""

from __future__ import annotations

import http.server
import socketserver
import threading
import time

import torch
import torch.distributed as dist

from ..console import print_rank_0
from ..device import get_device
from ..errors import ConfigError
from ..parallel.pipeline.trace import Trace
from ..perf.numbers import figure

_COLUMNS = ("compute_s", "iterations", "flops", "tp", "pp", "dp", "cp", "switch")


def device_clock(device: torch.device):
    """Seconds from ``time.perf_counter``, after the GPU's queued work when ``device`` is one."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return clock


class _Toggle(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.server.wanted = not self.server.wanted
        body = f"straggler detector {'on' if self.server.wanted else 'off'} from the next report\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - no line per request on the training console
        pass


class _Server(http.server.HTTPServer):
    def server_bind(self):
        """Bind without HTTPServer's host-name lookup (``socket.getfqdn``, slow where DNS is)."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "rank0", self.server_address[1]


class ControlServer:
    """Rank 0's switch: an HTTP server on ``port`` (all interfaces) in a daemon thread; ``wanted`` is
    the state asked for (starts as ``enabled``), flipped by every GET. Raises OSError when the port is taken."""

    def __init__(self, port: int, enabled: bool, host: str = ""):
        self.httpd = _Server((host, port), _Toggle)
        self.httpd.wanted = enabled
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="straggler-ctrlr", daemon=True)
        self.thread.start()

    @property
    def wanted(self) -> bool:
        return self.httpd.wanted

    def close(self) -> None:
        self.httpd.shutdown()  # serve_forever returns; the thread ends
        self.httpd.server_close()
        self.thread.join()


def _start_server(logging, rank: int, enabled: bool) -> ControlServer | None:
    """Rank 0's control server; every rank raises the same ConfigError when rank 0 could not bind
    its port (rank 0's outcome broadcast: the ranks stop together)."""
    server, error = None, ""
    if rank == 0:
        try:
            server = ControlServer(logging.straggler_ctrlr_port, enabled)
        except OSError as err:
            error = err.strerror or str(err)
    failed = bool(error)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1.0 if failed else 0.0], device=get_device())
        dist.broadcast(flag, src=0)
        failed = bool(flag.item())
    if failed:
        reason = f" ({error})" if error else ""
        raise ConfigError(f"--straggler-ctrlr-port {logging.straggler_ctrlr_port}: rank 0 cannot serve the straggler "
                          f"detector's switch on that port{reason}; give a free port")
    return server


class StragglerDetector:
    """Times this rank's compute (``step_trace`` for ``train_step``, ``after_step``) and reports the
    slowest and fastest ranks every log interval (``report``, a collective of every rank). ``clock``:
    seconds, read at each op's start and end (default :func:`device_clock`; a test passes a fake one).
    ``flops_per_iteration`` is the model FLOPs of one full global batch of ``global_batch_size`` samples."""

    def __init__(self, logging, state, flops_per_iteration: float, global_batch_size: int, clock=None):
        self.active = bool(logging.log_straggler)
        self.enabled = self.active and not logging.disable_straggler_on_startup
        self.count, self.log_interval = logging.straggler_minmax_count, logging.log_interval
        self.state = state
        self.flops_per_sample = float(flops_per_iteration) / max(1, global_batch_size) / max(1, state.world_size)
        self.trace = Trace(clock=clock or device_clock(get_device()))
        self.server = _start_server(logging, state.rank, self.enabled) if self.active else None
        self._reset()

    def _reset(self) -> None:
        self.compute_s, self.iterations, self.flops = 0.0, 0, 0.0

    def step_trace(self) -> Trace | None:
        """The trace for this step's schedule (None while the detector is off: nothing timed)."""
        return self.trace if self.enabled else None

    def after_step(self, batch_size: int, iteration: int | None = None) -> str | None:
        """Add the step's op times and its FLOPs (``batch_size`` samples) to the interval's; at a
        multiple of ``--log-interval`` (``iteration`` given), :meth:`report` (a collective)."""
        if self.enabled:
            self.compute_s += sum(end - start for start, end in self.trace.times)
            self.trace.clear()
            self.trace.times.clear()
            self.iterations += 1
            self.flops += self.flops_per_sample * batch_size
        if iteration is not None and iteration % self.log_interval == 0:
            return self.report(iteration)
        return None

    def _switch(self) -> bool:
        return self.server.wanted if self.server is not None else self.enabled

    def report(self, iteration: int) -> str | None:
        """Every rank, at a log interval: gather the rows (detector on) or learn rank 0's switch
        (off); rank 0 prints and returns the line (None elsewhere, or with nothing timed)."""
        if not self.active:
            return None
        line = None
        if self.enabled:
            s = self.state
            row = [self.compute_s, self.iterations, self.flops, s.tp_rank, s.pp_rank, s.dp_rank, s.cp_rank,
                   float(self._switch())]
            rows = _all_rows(row)
            switch = bool(rows[0][_COLUMNS.index("switch")])
            if s.rank == 0 and all(r[1] > 0 for r in rows):
                line = format_report(iteration, rows, self.count, s.cp_size > 1)
                print(line, flush=True)
        else:
            switch = _rank0_value(self._switch())
        self._reset()
        self.trace.clear()
        self.trace.times.clear()
        if switch != self.enabled:
            print_rank_0(f"> straggler detector switched {'on' if switch else 'off'} after iteration {iteration}")
            self.enabled = switch
        return line

    def close(self) -> None:
        """Stop rank 0's control server (its thread ends)."""
        if self.server is not None:
            self.server.close()
            self.server = None


def _all_rows(row: list[float]) -> list[list[float]]:
    """Every rank's row, in rank order (one all-gather; just this row in one process)."""
    mine = torch.tensor(row, dtype=torch.float64, device=get_device())
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine.tolist()]
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _rank0_value(value: bool) -> bool:
    """Rank 0's ``value`` on every rank (one broadcast)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([1.0 if value else 0.0], device=get_device())
    dist.broadcast(t, src=0)
    return bool(t.item())


def _describe(rank: int, row: list[float], with_cp: bool) -> str:
    compute_s, iterations, flops, tp, pp, dp, cp = row[:7]
    where = f"tp {int(tp)} pp {int(pp)} dp {int(dp)}" + (f" cp {int(cp)}" if with_cp else "")
    ms = 1000.0 * compute_s / iterations
    tflops = flops / compute_s / 1e12 if compute_s > 0 else float("inf")
    return f"rank {rank} ({where}) {ms:.1f} ms {figure(tflops)} TFLOP/s"


def format_report(iteration: int, rows: list[list[float]], count: int, with_cp: bool = False) -> str:
    """The report line from every rank's row (:data:`_COLUMNS`; list index = global rank): the
    ``count`` slowest and fastest ranks by compute time per iteration, and max/min of that time."""
    per_iter = [r[0] / r[1] for r in rows]
    order = sorted(range(len(rows)), key=lambda r: (per_iter[r], r))
    n = min(count, len(rows))
    slowest, fastest = order[::-1][:n], order[:n]
    ratio = per_iter[order[-1]] / per_iter[order[0]] if per_iter[order[0]] > 0 else float("inf")
    return (f" straggler | iteration {iteration} | compute time per iteration max/min: {ratio:.2f} |"
            f" slowest {n}: {', '.join(_describe(r, rows[r], with_cp) for r in slowest)} |"
            f" fastest {n}: {', '.join(_describe(r, rows[r], with_cp) for r in fastest)} |")
