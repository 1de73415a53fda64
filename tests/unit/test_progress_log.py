"""--log-progress: <save>/progress.txt in Megatron-LM's format (tab-separated: time, job id, world
size, event and, per saved checkpoint, iteration, throughputs, floating-point operations and tokens),
appended by a resumed run, with the cumulative figure counted from the first start of this world size."""

from datetime import datetime

import pytest

import pretrain_gpt
from megatron_lite.arguments import parse_args
from megatron_lite.perf.flops import num_floating_point_operations
from megatron_lite.training.progress import ProgressLog

TINY = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0",
        "--lr-decay-style", "constant", "--log-progress", "--save-interval", "2"]


def _lines(save):
    return [line.rstrip("\n").split("\t") for line in open(save / "progress.txt")]


def test_progress_lines_of_a_run_and_its_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    save = tmp_path / "ckpt"
    pretrain_gpt.main(TINY + ["--save", str(save), "--train-iters", "4"])
    pretrain_gpt.main(TINY + ["--save", str(save), "--load", str(save), "--train-iters", "6",
                       "--override-opt_param-scheduler"])
    lines = _lines(save)
    assert [f[3] for f in lines] == ["Starting job", "Saved checkpoint", "Saved checkpoint", "Starting job",
                                     "Saved checkpoint"]
    for f in lines:
        datetime.strptime(f[0], "%Y-%m-%d %H:%M:%S")
        assert f[1:3] == ["Job ID: 4242", "# GPUs: 1"]
    config = parse_args(TINY + ["--train-iters", "6", "--save", str(save)])
    pretrain_gpt.set_vocab(config, pretrain_gpt.build_tokenizer_for(config))
    per_iteration = num_floating_point_operations(config.model, 2, moe_config=config.moe)
    for f, iteration in zip([lines[1], lines[2], lines[4]], [2, 4, 6]):
        assert f[4] == f"Iteration: {iteration}"
        assert f[5].startswith("Job throughput: ") and f[5].endswith(" TFLOP/s/GPU")
        assert f[6].startswith("Cumulative throughput: ") and f[6].endswith(" TFLOP/s/GPU")
        assert f[7] == f"Floating-point operations: {iteration * per_iteration:.2e}"
        assert f[8] == f"Tokens (in billions): {iteration * 2 * 8 / 1e9:.2f}"


def test_cumulative_throughput_counts_from_the_first_start_of_this_world_size(tmp_path):
    lines = ["2026-01-01 00:00:00\tJob ID: \t# GPUs: 1\tStarting job",
             "2026-01-01 01:00:00\tJob ID: \t# GPUs: 2\tStarting job",  # another world size ...
             "2026-01-01 02:00:00\tJob ID: \t# GPUs: 2\tSaved checkpoint\tIteration: 5\tJob throughput: 1.0 TFLOP/s/GPU"
             "\tCumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: 3.00e+15\tTokens (in billions): 0.00",
             "2026-01-01 03:00:00\tJob ID: \t# GPUs: 1\tStarting job",  # ... so one GPU counts from here
             "2026-01-01 04:00:00\tJob ID: \t# GPUs: 1\tStarting job"]
    (tmp_path / "progress.txt").write_text("\n".join(lines) + "\n")
    log = ProgressLog(parse_args(TINY + ["--save", str(tmp_path)]), 1e9, 0)
    assert log._first_start() == (datetime(2026, 1, 1, 3), pytest.approx(3e15))


def test_the_job_throughput_is_per_gpu_of_the_world_size(tmp_path, monkeypatch):
    """'# GPUs' is the world size and 'Job throughput' this job's FLOPs per second and GPU: 4 processes
    of which rank 0 writes, 2 s after the start, 4 samples of 4e12 FLOPs: 16e12 / 2 s / 4 = 2.0 (the run
    above has one process, where a missing division by the world size does not show)."""
    from types import SimpleNamespace

    from megatron_lite.training import progress

    clock = {"now": 1000.0}
    monkeypatch.setattr(progress, "dist", SimpleNamespace(is_initialized=lambda: True, get_rank=lambda: 0,
                                                          get_world_size=lambda: 4))
    monkeypatch.setattr(progress, "time", SimpleNamespace(time=lambda: clock["now"]))
    config = parse_args(TINY + ["--save", str(tmp_path), "--global-batch-size", "8"], world_size=4)
    log = ProgressLog(config, 32e12, 0)  # 4e12 a sample
    clock["now"] += 2.0
    log.saved(2, 4)
    start, saved = _lines(tmp_path)
    assert start[2:] == ["# GPUs: 4", "Starting job"]
    assert saved[2] == "# GPUs: 4" and saved[5] == "Job throughput: 2.0 TFLOP/s/GPU", saved
    assert saved[7] == "Floating-point operations: 1.60e+13"


def test_a_small_throughput_keeps_three_significant_figures(tmp_path, monkeypatch):
    """A tiny model on CPU used to read 'Job throughput: 0.0 TFLOP/s/GPU' (Megatron's one decimal):
    below 1 TFLOP/s the figures are three significant ones; from 1 on the line is Megatron's (above)."""
    from types import SimpleNamespace

    from megatron_lite.training import progress

    clock = {"now": 1000.0}
    monkeypatch.setattr(progress, "time", SimpleNamespace(time=lambda: clock["now"]))
    config = parse_args(TINY + ["--save", str(tmp_path), "--global-batch-size", "8"])
    log = ProgressLog(config, 8e9, 0)  # 1e9 a sample
    clock["now"] += 3.0
    log.saved(2, 4)  # 4e9 / 3 s / 1e12
    saved = _lines(tmp_path)[1]
    assert saved[5] == "Job throughput: 0.00133 TFLOP/s/GPU", saved
    cumulative = saved[6].removeprefix("Cumulative throughput: ").removesuffix(" TFLOP/s/GPU")
    assert float(cumulative) > 0, saved
    assert [progress._tflops(x) for x in (151.34, 1.0, 0.96, 0.0)] == ["151.3", "1.0", "0.96", "0"]
