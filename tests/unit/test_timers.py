"""Named timers add up start/stop intervals (a fake clock makes the arithmetic exact)."""

import pytest

from megatron_lite.training import timers as timers_mod
from megatron_lite.training.timers import Timers


def test_intervals_accumulate_and_reset(monkeypatch):
    clock = iter([1.0, 3.0, 10.0, 10.5, 20.0])
    monkeypatch.setattr(timers_mod.time, "perf_counter", lambda: next(clock))
    timers = Timers()
    t = timers("iteration-time")
    t.start()   # 1.0
    t.stop()    # 3.0 -> 2.0
    t.start()   # 10.0
    t.stop()    # 10.5 -> 2.5
    assert timers.elapsed(["iteration-time"]) == {"iteration-time": 2.5}
    assert t.elapsed() == 0.0, "elapsed(reset=True) cleared the total"
    t.start()   # 20.0
    with pytest.raises(RuntimeError, match="already running"):
        t.start()
    assert timers.names() == ["iteration-time"]


def test_stop_without_start_is_an_error():
    with pytest.raises(RuntimeError, match="without being started"):
        Timers()("x").stop()


def test_log_string(monkeypatch):
    clock = iter([0.0, 0.5, 1.0, 1.25])
    monkeypatch.setattr(timers_mod.time, "perf_counter", lambda: next(clock))
    timers = Timers()
    for name in ("forward-backward", "optimizer"):
        timers(name).start()
        timers(name).stop()
    assert timers.log_string(normalizer=2) == "time (ms) | forward-backward: 250.00 | optimizer: 125.00"
