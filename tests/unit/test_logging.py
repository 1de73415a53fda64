"""Console lines in Megatron's format, averaged over the interval, printed by the right rank only;
TensorBoard event files carry Megatron's scalar names."""

import glob
import re
from types import SimpleNamespace

import pytest

from megatron_lite.config import Config
from megatron_lite.console import is_logging_rank, print_rank_0
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training.logging import TrainLogger
from tests.cli_errors import parse_refused

NUM = r"[-+]?\d+\.\d+"
SCI = r"[-+]?\d\.\d{6}E[-+]\d{2}"
LINE = re.compile(
    r"^ \[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\]"
    r" iteration +(?P<it>\d+)/ +(?P<total>\d+) \|"
    r" consumed samples: +(?P<consumed>\d+) \|"
    rf" elapsed time per iteration \(ms\): (?P<ms>{NUM}) \|"
    rf" throughput per GPU \(TFLOP/s/GPU\): (?P<tflops>{NUM}) \|"
    rf" learning rate: (?P<lr>{SCI}) \|"
    r" global batch size: +(?P<gbs>\d+) \|"
    rf" lm loss: (?P<loss>{SCI}) \|"
    rf" loss scale: (?P<scale>{NUM}) \|"
    rf" grad norm: (?P<gnorm>\d+\.\d{{3}}) \|"
    r" number of skipped iterations: +(?P<skipped>\d+) \|"
    r" number of nan iterations: +(?P<nan>\d+) \|"
    rf" tokens per second per device: (?P<tps>{NUM}) \|"
    rf" peak memory \(MB\): (?P<mem>{NUM}) \|$"
)


def _config(tmp_path=None, interval=2):
    cfg = Config()
    cfg.model.seq_length = 128
    cfg.training.train_iters = 100
    cfg.logging.log_interval = interval
    cfg.logging.log_throughput = True
    cfg.logging.tensorboard_dir = None if tmp_path is None else str(tmp_path / "tb")
    return cfg


def test_line_format_and_interval_averages(capsys):
    log = TrainLogger(_config(), ParallelState(), flops_per_iteration=2e12)
    common = dict(lr=3e-4, loss_scale=1.0, nan=False, batch_size=4)
    assert log.log_iteration(1, {"lm loss": 2.0}, grad_norm=1.0, skipped=False, iter_time_s=0.1, **common) is None
    line = log.log_iteration(2, {"lm loss": 4.0}, grad_norm=2.5, skipped=False, iter_time_s=0.3, **common)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [line], "exactly one line is printed, at the log interval"
    m = LINE.match(line)
    assert m, line
    assert int(m["it"]) == 2 and int(m["total"]) == 100 and int(m["consumed"]) == 8
    assert float(m["loss"]) == pytest.approx(3.0)  # mean of 2 and 4
    assert float(m["ms"]) == pytest.approx(200.0)  # mean of 100 ms and 300 ms
    assert float(m["lr"]) == pytest.approx(3e-4) and int(m["gbs"]) == 4
    assert m["gnorm"] == "2.500"  # the last iteration's
    assert float(m["tflops"]) == pytest.approx(10.0, abs=0.05)  # 2e12 FLOPs / 0.2 s / 1 device
    assert float(m["tps"]) == pytest.approx(2 * 4 * 128 / 0.4)
    assert float(m["mem"]) > 0
    assert int(m["skipped"]) == 0 and int(m["nan"]) == 0

    # Next interval: a skipped step does not enter the loss average; a nan step is counted.
    log.log_iteration(3, {"lm loss": 100.0}, grad_norm=None, skipped=True, iter_time_s=0.2, **common)
    line = log.log_iteration(4, {"lm loss": 5.0}, grad_norm=1.0, skipped=False, iter_time_s=0.2,
                             **{**common, "nan": True})
    m = LINE.match(line)
    assert m, line
    assert float(m["loss"]) == pytest.approx(5.0)
    assert int(m["skipped"]) == 1 and int(m["nan"]) == 1 and int(m["consumed"]) == 16


def test_throughput_field_follows_log_throughput_flag():
    cfg = _config(interval=1)
    cfg.logging.log_throughput = False
    line = TrainLogger(cfg, ParallelState(), 1e9).log_iteration(
        1, {"lm loss": 1.0}, 1e-3, 1.0, 1.0, False, False, 0.5, 2)
    assert "throughput per GPU" not in line and "| learning rate: 1.000000E-03 |" in line


def test_validation_line(capsys):
    log = TrainLogger(_config(), ParallelState(), 1e9)
    line = log.log_validation(10, {"lm loss": 2.0})
    assert line == " validation loss at iteration 10 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 |"
    out = capsys.readouterr().out.splitlines()
    assert out[1] == line and set(out[0]) == {"-"} and out[0] == out[2]


def _fake_state(last, tp, dp):
    return SimpleNamespace(is_last_stage=lambda: last, tp_rank=tp, dp_rank=dp, cp_rank=0, world_size=8)


def test_per_device_figures_divide_by_the_world_size():
    """"tokens per second per device" and "throughput per GPU" divide the global batch's tokens and
    FLOPs by every process of the run (8 here; the line's test above runs 1, where dividing or not
    is the same)."""
    log = TrainLogger(_config(interval=1), _fake_state(True, 0, 0), flops_per_iteration=2e12)
    line = log.log_iteration(1, {"lm loss": 2.0}, grad_norm=1.0, skipped=False, iter_time_s=0.25, lr=3e-4,
                             loss_scale=1.0, nan=False, batch_size=4)
    m = LINE.match(line)
    assert m, line
    assert float(m["tps"]) == pytest.approx(4 * 128 / 0.25 / 8)  # 256.0
    assert float(m["tflops"]) == pytest.approx(2e12 / 0.25 / 1e12 / 8)  # 1.0


def test_only_last_stage_tp0_dp0_prints(capsys):
    assert is_logging_rank(_fake_state(True, 0, 0))
    for state in (_fake_state(False, 0, 0), _fake_state(True, 1, 0), _fake_state(True, 0, 1)):
        assert not is_logging_rank(state)
        log = TrainLogger(_config(interval=1), state, 1e9)
        assert log.log_iteration(1, {"lm loss": 1.0}, 1e-3, 1.0, 1.0, False, False, 0.5, 2) is None
        assert log.log_validation(1, {"lm loss": 1.0}) is None
    assert capsys.readouterr().out == ""


def test_print_rank_0_prints_without_distributed(capsys):
    print_rank_0("hello")
    assert capsys.readouterr().out == "hello\n"


def test_tensorboard_scalar_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = _config(tmp_path)
    config.logging.log_batch_size_to_tensorboard = config.logging.log_validation_ppl_to_tensorboard = True
    log = TrainLogger(config, ParallelState(), 1e9)
    for it in (1, 2):
        log.log_iteration(it, {"lm loss": 3.0 - it}, 1e-3, 0.5, 1.0, False, False, 0.1, 4, params_norm=10.0)
    log.log_validation(2, {"lm loss": 1.5})
    log.close()
    files = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(files[0])
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"lm loss", "learning-rate", "grad-norm", "loss-scale", "batch-size", "iteration-time", "throughput",
            "params-norm", "lm loss validation", "lm loss validation ppl", "tokens-per-second-per-device"}
    assert want <= tags, want - tags
    assert any(t.startswith("mem-max-") for t in tags)
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [(1, 2.0), (2, 1.0)]
    assert [e.value for e in acc.Scalars("lm loss validation")] == [1.5]


def _tensorboard_tags(tmp_path, **flags):
    """The scalar tags (with their steps) of 4 logged iterations and one validation under ``flags``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = _config(tmp_path, interval=100)
    for name, value in flags.items():
        setattr(config.logging, name, value)
    log = TrainLogger(config, ParallelState(), 1e9)
    for it in (1, 2, 3, 4):
        log.log_iteration(it, {"lm loss": 3.0 - it}, 1e-3, 0.5, 1.0, False, False, 0.1, 4)
    log.log_validation(4, {"lm loss": 1.5})
    log.close()
    [path] = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    acc = EventAccumulator(path)
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_defaults_are_megatrons(tmp_path):
    """Learning rate and loss scale on, batch size, world size, memory and validation perplexity off."""
    tags = _tensorboard_tags(tmp_path)
    assert tags["learning-rate"] == tags["loss-scale"] == tags["lm loss"] == [1, 2, 3, 4]
    assert not {"batch-size", "world-size", "lm loss validation ppl", "mem-rss-bytes"} & set(tags)
    assert tags["lm loss validation"] == [4]


@pytest.mark.parametrize("size", [None, 7])
def test_tensorboard_queue_size_reaches_the_writer(tmp_path, size):
    """--tensorboard-queue-size (Megatron-LM's default 1000) is the writer's queue of pending events."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.training.writers import build_writer

    flags = ["--mock-data", "--vocab-size", "64", "--tensorboard-dir", str(tmp_path / "tb")]
    writer = build_writer(parse_args(flags + (["--tensorboard-queue-size", str(size)] if size else [])))
    try:
        assert writer.max_queue == (size or 1000)
    finally:
        writer.close()


def test_tensorboard_flags_and_interval(tmp_path):
    tags = _tensorboard_tags(tmp_path, tensorboard_log_interval=2, log_learning_rate_to_tensorboard=False,
                             log_loss_scale_to_tensorboard=False, log_batch_size_to_tensorboard=True,
                             log_world_size_to_tensorboard=True, log_memory_to_tensorboard=True,
                             log_validation_ppl_to_tensorboard=True)
    assert not {"learning-rate", "loss-scale"} & set(tags)
    assert tags["lm loss"] == tags["batch-size"] == tags["world-size"] == tags["grad-norm"] == [2, 4]
    assert tags["mem-rss-bytes"] == tags["mem-max-rss-bytes"] == [2, 4]  # the CPU's figures
    assert tags["lm loss validation ppl"] == [4]


@pytest.mark.parametrize("flags, words", [
    (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval must be at least 1, got 0"),
    (["--tensorboard-queue-size", "0"], "--tensorboard-queue-size must be at least 1, got 0"),
    (["--log-progress"], "--log-progress writes <save>/progress.txt: add --save DIR"),
])
def test_bad_logging_flags_are_one_line_exit_2(capsys, flags, words):

    parse_refused(capsys, ["--mock-data", "--vocab-size", "64"] + flags, words)


def test_throughput_of_a_tiny_model_is_not_printed_as_zero(capsys):
    """A CPU run of a tiny model does ~1e-3 TFLOP/s: the line shows two significant digits, not 0.0."""
    log = TrainLogger(_config(interval=1), ParallelState(), flops_per_iteration=4.2e8)
    line = log.log_iteration(1, {"lm loss": 2.0}, grad_norm=1.0, skipped=False, iter_time_s=0.1, lr=3e-4,
                             loss_scale=1.0, nan=False, batch_size=4)
    assert " throughput per GPU (TFLOP/s/GPU): 0.0042 |" in line


def test_figures_keep_their_digits_at_any_size():
    from megatron_lite.perf.numbers import count, figure

    assert [figure(x) for x in (0, 812.34, 1.25, 0.0042, 3.1e-7)] == ["0.0", "812.3", "1.2", "0.0042", "3.1e-07"]
    assert [figure(x) for x in (0.996, -0.999, 0.994)] == ["1.0", "-1.0", "0.99"]  # one decimal from 1 up, as rounded
    assert [count(n) for n in (6.74e9, 124.4e6, 33952, 512)] == ["6.74 B", "124.4 M", "34.0 K", "512"]
    assert [count(n) for n in (999_999, 999_960_000, 999_940, 999)] == ["1.0 M", "1.00 B", "999.9 K", "999"]


@pytest.mark.parametrize("recompute", [[], ["--recompute-granularity", "full", "--recompute-method", "block",
                                            "--recompute-num-layers", "1"],
                                       ["--recompute-granularity", "full", "--recompute-method", "uniform"]])
def test_logged_throughput_counts_the_model_flops_whatever_is_recomputed(monkeypatch, recompute):
    """--log-throughput is Narayanan et al.'s model FLOPs, 72·B·s·l·h²·(1 + s/6h + V/12lh), as docs/training.md
    and Megatron-LM say: full recomputation of 1 of 2 layers (or of both) does not turn it into the 96·... count."""
    import pretrain_gpt
    from megatron_lite.perf.flops import spec_formula
    from megatron_lite.training import loop

    seen = []

    class Recording(TrainLogger):
        def __init__(self, config, state, flops_per_iteration, *args, **kwargs):
            seen.append(flops_per_iteration)
            super().__init__(config, state, flops_per_iteration, *args, **kwargs)

    monkeypatch.setattr(loop, "TrainLogger", Recording)
    pretrain_gpt.main(["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
                       "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
                       "--global-batch-size", "4", "--train-iters", "1", "--eval-iters", "0", "--log-throughput"]
                      + recompute)
    assert seen == [spec_formula(4, 16, 2, 32, 128)]  # the vocabulary padded to 128
