"""--timing-log-level / --log-timers-to-tensorboard: per-phase times in the console and TensorBoard,
nothing extra at level 0, and the same losses with and without timing."""

import glob

import pytest
import torch

import megatron_lite.training.timers as timers_module
import pretrain_gpt
from megatron_lite.training.timers import Timers, format_timers

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--mock-data", "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "4", "--log-interval", "2", "--eval-iters", "0", "--attention-dropout", "0",
    "--hidden-dropout", "0",
]
LEVEL1 = ["forward-backward", "batch-generator", "all-grads-sync", "optimizer"]


class _Clock:
    """A stand-in for ``time.perf_counter``: time moves only when the test says so."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_timers_accumulate_and_average_per_iteration(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timers_module, "time", clock)
    timers = Timers(1, torch.device("cpu"))
    for seconds in (0.010, 0.030):  # two iterations: 10 ms and 30 ms in the optimizer
        with timers.phase("optimizer"):
            clock.now += seconds
        with timers.phase("lr-scheduler"):  # level 2: not timed at level 1
            clock.now += 1.0
        timers.iterations += 1

    def batches():
        for b in (1, 2):
            clock.now += 0.004  # waiting 4 ms for each batch
            yield b

    it = timers.timed_iterator(batches())
    assert list(it) == [1, 2]
    times = timers.take()
    assert times.keys() == {"optimizer", "batch-generator"}
    assert times["optimizer"] == pytest.approx(20.0)  # ms per iteration: (10 + 30) / 2
    assert times["batch-generator"] == pytest.approx(4.0)  # 2 x 4 ms over the same 2 iterations
    assert timers.take() == {}  # reset
    assert format_timers({"optimizer": 1.5}) == " time (ms) | optimizer: 1.50 |"
    assert Timers(0, torch.device("cpu")).timed_iterator(it) is it  # level 0: untouched


def _scalars(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [path] = glob.glob(f"{tb_dir}/events.out.tfevents.*")
    acc = EventAccumulator(path)
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("level", [1, 2])
def test_timers_in_console_and_tensorboard(tmp_path, capsys, level):
    reference = pretrain_gpt.main(TINY).losses
    capsys.readouterr()
    timed = pretrain_gpt.main(TINY + ["--timing-log-level", str(level), "--log-timers-to-tensorboard",
                                      "--tensorboard-dir", str(tmp_path / "tb")]).losses
    assert timed == reference  # timing changes nothing in training
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" time (ms) |")]
    assert len(lines) == 2  # one per log interval (iterations 2 and 4)
    names = LEVEL1 + (["lr-scheduler"] if level == 2 else [])
    for name in names:
        assert f" {name}: " in lines[0]
    scalars = _scalars(tmp_path / "tb")
    for name in names:
        assert set(scalars[f"{name}-time"]) == {2, 4}
    for step in (2, 4):  # waiting for data happens inside the forward-backward phase
        assert scalars["batch-generator-time"][step] <= scalars["forward-backward-time"][step]


def test_level_0_adds_nothing(tmp_path, capsys):
    pretrain_gpt.main(TINY + ["--log-timers-to-tensorboard", "--tensorboard-dir", str(tmp_path / "tb")])
    assert " time (ms) |" not in capsys.readouterr().out
    assert not [tag for tag in _scalars(tmp_path / "tb") if tag.endswith("-time") and tag != "iteration-time"]
