"""The straggler detector (--log-straggler, megatron_lite/training/straggler.py).

A fake clock makes rank 1 of two gloo ranks three times slower: rank 0's report names rank 1 the
slowest and rank 0 the fastest, with the ratio and each rank's TFLOP/s from the FLOP count; the
times come from the pipeline schedule's ops (the Trace the detector hands to train_step). The
control port's GET switches the detector on every rank at the next report (rank 0's server, the
switch sent in the gathered rows or broadcast); the server thread ends on close. A port in use is
one line, exit 2, on every rank; the flags' refusals too. (Through torchrun, with the real clock:
tests/e2e/test_torchrun.py's finished-run test.)
"""

import socket
import threading
import urllib.request
from types import SimpleNamespace

import pytest

import pretrain_gpt
from megatron_lite.config import ConfigError
from megatron_lite.logging_config import LoggingConfig
from megatron_lite.parallel.pipeline.trace import _Recorder
from megatron_lite.training.straggler import StragglerDetector, format_report
from tests.cli_errors import parse_refused, refused_line
from tests.harness import free_port, run_ranks

FLOPS = 4e12  # of one global batch of 8 samples


class FakeClock:
    """Advances ``tick`` seconds per reading."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _state(rank=0, world_size=1, dp_rank=0):
    return SimpleNamespace(rank=rank, world_size=world_size, tp_rank=0, pp_rank=0, dp_rank=dp_rank, cp_rank=0,
                           cp_size=1)


def _step(det, microbatches=2):
    """One training step as the schedule runs it: an F and a B op per micro-batch, timed by the detector's trace."""
    rec = _Recorder(det.step_trace(), 0)
    for mb in range(microbatches):
        for kind in "FB":
            with rec.op(kind, mb, 0):
                pass
    det.after_step(8)


def _toggle(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as reply:
        return reply.read().decode()


def _two_ranks(port: int):
    """Inside a rank: rank 1's clock ticks 3 s, rank 0's 1 s; two intervals of two steps, the detector
    switched off through the port after the first and on again after the second."""
    import torch.distributed as dist

    rank = dist.get_rank()
    det = StragglerDetector(LoggingConfig(log_straggler=True, straggler_ctrlr_port=port), _state(rank, 2, rank),
                            FLOPS, 8, clock=FakeClock(3.0 if rank == 1 else 1.0))
    try:
        _step(det)
        _step(det)
        if rank == 0:
            assert _toggle(port) == "straggler detector off from the next report\n"
        lines = [det.report(2)]
        off = (det.enabled, det.step_trace())
        _step(det)
        if rank == 0:
            _toggle(port)
        lines.append(det.report(3))  # off during the interval: no line; the switch is broadcast
        _step(det)
        lines.append(det.report(4))
        return lines, off, det.enabled
    finally:
        det.close()


def test_the_slow_rank_is_named_and_the_port_switches_every_rank():
    results = run_ranks(2, _two_ranks, free_port())
    (lines, off, on), (lines1, off1, on1) = results
    assert off == off1 == (False, None) and on and on1
    assert lines1 == [None, None, None]  # rank 0 prints
    # each op reads the clock twice: 1 s (rank 0) or 3 s (rank 1) per op, 4 ops a step
    assert lines[0] == (" straggler | iteration 2 | compute time per iteration max/min: 3.00 |"
                        " slowest 1: rank 1 (tp 0 pp 0 dp 1) 12000.0 ms 0.17 TFLOP/s |"
                        " fastest 1: rank 0 (tp 0 pp 0 dp 0) 4000.0 ms 0.5 TFLOP/s |")  # 2e12 FLOPs a rank a step
    assert lines[1:] == [None, " straggler | iteration 4 | compute time per iteration max/min: 3.00 |"
                                " slowest 1: rank 1 (tp 0 pp 0 dp 1) 12000.0 ms 0.17 TFLOP/s |"
                                " fastest 1: rank 0 (tp 0 pp 0 dp 0) 4000.0 ms 0.5 TFLOP/s |"]


def _port_taken(port: int):
    import torch.distributed as dist

    holder = None
    if dist.get_rank() == 0:
        holder = socket.socket()
        holder.bind(("", port))
        holder.listen()
    try:
        StragglerDetector(LoggingConfig(log_straggler=True, straggler_ctrlr_port=port), _state(dist.get_rank(), 2),
                          FLOPS, 8)
    except ConfigError as err:
        return str(err)
    finally:
        if holder is not None:
            holder.close()
    return None


def test_a_port_in_use_stops_every_rank():
    port = free_port()
    for message in run_ranks(2, _port_taken, port):
        assert message is not None and message.startswith(f"--straggler-ctrlr-port {port}: rank 0 cannot serve")


def test_report_names_count_ranks_each_way():
    rows = [[1.0, 2, 1e12, 0, 0, r, 0, 1.0] for r in range(4)]
    rows[2][0], rows[3][0] = 4.0, 2.0
    line = format_report(10, rows, 2)
    assert "max/min: 4.00 |" in line
    assert "slowest 2: rank 2 (tp 0 pp 0 dp 2) 2000.0 ms 0.25 TFLOP/s, rank 3 (tp 0 pp 0 dp 3) 1000.0 ms" in line
    assert "fastest 2: rank 0 (tp 0 pp 0 dp 0) 500.0 ms 1.0 TFLOP/s, rank 1 (tp 0 pp 0 dp 1)" in line
    assert "slowest 4:" in format_report(10, rows, 9)  # the count is at most the world size


def test_off_times_nothing_and_starts_no_server():
    det = StragglerDetector(LoggingConfig(), _state(), FLOPS, 8, clock=FakeClock(1.0))
    assert det.step_trace() is None and det.server is None and det.report(1) is None


def test_disabled_on_startup_and_switched_on_through_the_port(capsys):
    port = free_port()
    det = StragglerDetector(LoggingConfig(log_straggler=True, disable_straggler_on_startup=True,
                                          straggler_ctrlr_port=port), _state(), FLOPS, 8, clock=FakeClock(1.0))
    try:
        assert det.step_trace() is None
        _step(det)
        assert det.report(1) is None
        assert _toggle(port) == "straggler detector on from the next report\n"
        assert det.step_trace() is None  # from the next report on
        assert det.report(2) is None
        assert "> straggler detector switched on after iteration 2" in capsys.readouterr().out
        _step(det)
        assert "max/min: 1.00" in det.report(3)
    finally:
        det.close()
    assert det.server is None and not any(t.name == "straggler-ctrlr" for t in threading.enumerate())


@pytest.mark.parametrize("argv, words", [
    (["--log-straggler", "--straggler-minmax-count", "0"], ["--straggler-minmax-count", "at least 1"]),
    (["--log-straggler", "--straggler-ctrlr-port", "70000"], ["--straggler-ctrlr-port", "70000"]),
    (["--disable-straggler-on-startup"], ["--disable-straggler-on-startup", "add --log-straggler"]),
    (["--straggler-ctrlr-port", "8000"], ["--straggler-ctrlr-port", "add --log-straggler"]),
])
def test_refused_flags(capsys, argv, words):
    parse_refused(capsys, ["--mock-data", "--vocab-size", "64"] + argv, *words)


def test_a_port_in_use_is_one_line_before_the_first_step(capsys, tmp_path):
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        argv = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                "--mock-data", "--vocab-size", "64", "--micro-batch-size", "1", "--train-iters", "1",
                "--eval-iters", "0", "--log-straggler", "--straggler-ctrlr-port", str(port)]
        refused_line(capsys, lambda: pretrain_gpt.main(argv), f"--straggler-ctrlr-port {port}", "give a free port")
