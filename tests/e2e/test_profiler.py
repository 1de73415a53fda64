"""--profile --use-pytorch-profiler: a trace TensorBoard / Perfetto open, a per-op table and the time per
category in the log; the combinations that cannot work are refused in one line (exit code 2)."""

import glob
import json
import os
import re

import pytest
import torch

import pretrain_gpt
from megatron_lite.perf.op_categories import CATEGORIES

TINY = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--eval-iters", "0", "--log-interval", "1"]


def test_pytorch_profiler_writes_a_trace_and_prints_the_tables(tmp_path, capsys):
    board = tmp_path / "tb"
    pretrain_gpt.main(TINY + ["--train-iters", "4", "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                              "--profile-step-end", "3", "--tensorboard-dir", str(board)])
    out = capsys.readouterr().out
    traces = glob.glob(os.path.join(board, "rank0.*.pt.trace.json"))
    assert len(traces) == 1, os.listdir(board)
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]  # Chrome trace format: what Perfetto and TensorBoard read
    names = {e.get("name", "") for e in events}
    assert "optimizer_step" in names and any("aten::mm" in n or "aten::addmm" in n for n in names)
    assert "profile of iterations 2-3" in out and "Self CPU" in out
    table = out[out.index("self CPU time by category"):]
    for category in CATEGORIES:
        assert category in table
    gemm = float(next(line for line in table.splitlines() if line.strip().startswith("GEMM")).split()[1])
    assert gemm > 0
    assert re.search(r"rank 0: \d+ minor page faults in these iterations", out)


@pytest.mark.parametrize("extra, words", [
    pytest.param(["--profile"], ["--use-pytorch-profiler"], marks=pytest.mark.skipif(  # nsys needs a GPU
        torch.cuda.is_available(), reason="a GPU can run Nsight Systems")),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", "5", "--profile-step-end", "5"],
     ["--profile-step-start"]),
    (["--profile", "--use-pytorch-profiler", "--profile-ranks", "3"], ["--profile-ranks 3"]),
    (["--profile", "--use-pytorch-profiler", "--train-iters", "4"], ["--profile-step-start 10", "--train-iters 4"]),
    (["--profile", "--use-pytorch-profiler", "--train-iters", "3", "--profile-step-start", "3", "--profile-step-end", "5"],
     ["--profile-step-start 3", "--train-iters 3"]),
    # a run sized in samples: it named '--train-iters 4', a flag the user never passed
    (["--profile", "--use-pytorch-profiler", "--train-samples", "8", "--global-batch-size", "2", "--lr-decay-style",
      "constant"], ["--profile-step-start 10 is not below --train-samples 8 / --global-batch-size 2 = 4"]),
])
def test_profile_flags_refused_in_one_line(capsys, extra, words):
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + extra)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for w in words:
        assert w in lines[0]


def test_a_run_ending_inside_the_window_reports_the_iterations_it_recorded(tmp_path, capsys):
    """--profile-step-end 10 in a run of 3 iterations: the trace holds iterations 2-3, and the log says so
    (it said 2-10)."""
    pretrain_gpt.main(TINY + ["--train-iters", "3", "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                              "--profile-step-end", "10", "--tensorboard-dir", str(tmp_path / "tb")])
    out = capsys.readouterr().out
    assert "profile of iterations 2-3," in out, out[-2000:]
    assert len(glob.glob(os.path.join(tmp_path / "tb", "rank0.*.pt.trace.json"))) == 1


def test_a_resumed_run_profiles_the_rest_of_its_window_and_refuses_a_window_behind_it(tmp_path, capsys):
    """Resumed at iteration 2: a window 1-4 was never started (nothing recorded, nothing said); now iterations
    3-4 are. A window ending before the resumed iteration was silently skipped too; now one line, exit 2."""
    save = str(tmp_path / "ckpt")
    run = TINY + ["--lr-decay-iters", "4", "--save", save, "--save-interval", "2"]  # --lr-decay-iters: the resumed runs keep the schedule
    pretrain_gpt.main(run + ["--train-iters", "2"])
    capsys.readouterr()
    profile = ["--load", save, "--profile", "--use-pytorch-profiler", "--tensorboard-dir",
               str(tmp_path / "tb"), "--profile-step-start", "1"]
    pretrain_gpt.main(run + profile + ["--train-iters", "4", "--profile-step-end", "4"])
    assert "profile of iterations 3-4," in capsys.readouterr().out
    assert len(glob.glob(os.path.join(tmp_path / "tb", "rank0.*.pt.trace.json"))) == 1
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(run + profile + ["--train-iters", "6", "--profile-step-end", "3"])  # resumes at 4
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "resumes at iteration 4 and --profile-step-end is 3" in lines[0], lines


def test_a_file_named_profile_in_the_way_of_the_default_trace_folder_is_refused_first(tmp_path, monkeypatch, capsys):
    """Without --tensorboard-dir the trace goes to ./profile; a file by that name was a FileExistsError traceback
    at the end of the window, after the profiled steps; now one line before the first step, exit 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "profile").write_text("")
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--train-iters", "2", "--profile", "--use-pytorch-profiler", "--profile-step-start",
                                  "0", "--profile-step-end", "1"])
    assert err.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "--profile (no --tensorboard-dir) trace folder profile is a file" in lines[0], lines
    assert "iteration" not in captured.out


def test_the_trace_named_is_this_ranks_when_another_rank_writes_beside_it(tmp_path, monkeypatch, capsys):
    """Ranks profiled together write into one folder at the same moment: rank 0 named rank 1's trace (the
    newest file of the folder, sorted) when it landed between its listings; it names its own."""
    from megatron_lite.config import Config
    from megatron_lite.training.profiler import StepProfiler

    real = torch.profiler.tensorboard_trace_handler

    def also_rank1(folder, worker_name):
        (tmp_path / "rank1.2.pt.trace.json").write_text("{}")  # the other rank's, written meanwhile
        return real(folder, worker_name=worker_name)

    monkeypatch.setattr(torch.profiler, "tensorboard_trace_handler", also_rank1)
    cfg = Config().logging
    cfg.profile, cfg.use_pytorch_profiler, cfg.profile_step_start, cfg.tensorboard_dir = True, True, 0, str(tmp_path)
    profiler = StepProfiler(cfg, 0, torch.device("cpu"))
    profiler.before(0)
    torch.ones(4).sum()
    profiler.close()
    assert os.path.basename(profiler.trace_path).startswith("rank0."), profiler.trace_path
    assert "trace " + profiler.trace_path in capsys.readouterr().out


def test_only_the_profile_ranks_profile():
    """--profile-ranks (default 0): the ranks listed start the profiler at --profile-step-start, the others never."""
    from megatron_lite.config import Config
    from megatron_lite.training.profiler import StepProfiler

    cfg = Config().logging
    cfg.profile, cfg.use_pytorch_profiler = True, True
    assert [StepProfiler(cfg, r, torch.device("cpu")).enabled for r in range(3)] == [True, False, False]
    cfg.profile_ranks = [1, 2]
    assert [StepProfiler(cfg, r, torch.device("cpu")).enabled for r in range(3)] == [False, True, True]
    quiet = StepProfiler(cfg, 0, torch.device("cpu"))
    quiet.before(cfg.profile_step_start)
    assert quiet._prof is None
