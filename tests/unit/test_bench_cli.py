"""Every benchmark's command line keeps the project's promise for bad input: one line on stderr naming
the flag, exit code 2 (not argparse's usage block), before any work starts."""

import glob
import importlib
import os
import re
import sys

import pytest
import torch

from tests.cli_errors import refused_line
from tests.crash_child import crashing_rank

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(BENCH_DIR, "bench_*.py")))
SCRIPTS.append("cuda_checks")


def run_main(monkeypatch, name, *argv):
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    return lambda: module.main()


def test_every_benchmark_is_listed():
    assert len(SCRIPTS) > 20


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_unknown_flag_is_refused_in_one_line(monkeypatch, capsys, name):
    refused_line(capsys, run_main(monkeypatch, name, "--no-such-flag"), "--no-such-flag", "--help")


def test_the_sample_index_benchmark_prints_the_machine_and_no_ratio_at_other_sizes(capsys):
    from benchmarks import bench_sample_index
    from benchmarks.common import cpu_model

    bench_sample_index.main(["--documents", "500", "--seq-length", "64", "--blend-samples", "300", "--repeats", "1"])
    out = capsys.readouterr().out
    assert cpu_model() in out and "torch " in out and "threads " in out
    assert "| ratio" not in out and "no ratio at these sizes" in out  # the C++ figure was measured at 10 M documents, seq 2048
    assert "| ratio 0.50" in bench_sample_index.cpp_comparison(0.14, 10_000_000, 2048)


def test_the_preprocess_benchmark_names_the_cpu_model():
    from benchmarks import bench_preprocess
    from benchmarks.common import cpu_model

    assert bench_preprocess.machine().startswith(cpu_model() + ",")


def test_the_long_run_check_and_its_refusals(monkeypatch, capsys):
    from benchmarks import bench_long_run

    samples = [(50, 100.0, 9), (100, 120.0, 10), (150, 125.0, 10), (200, 125.9, 10)]
    assert bench_long_run.verdict(samples) == (True, "RSS step 200 vs step 100: +4.9%; open files 10 -> 10: PASS")
    assert not bench_long_run.verdict(samples[:-1] + [(200, 126.1, 10)])[0]
    assert not bench_long_run.verdict(samples[:-1] + [(200, 120.0, 11)])[0]
    # too short to have a step after 100: refused before the run, not a StopIteration after it
    refused_line(capsys, run_main(monkeypatch, "bench_long_run", "--iters", "100"), "--iters 100", "150")
    refused_line(capsys, run_main(monkeypatch, "bench_long_run", "--save-interval", "0"), "--save-interval")


def count_flags():
    """(benchmark, flag) of every count (rounds, steps, repeats, threads, ...) and every positive size,
    peak or timeout a benchmark takes."""
    pattern = re.compile(r'"(--[a-z0-9-]+)", type=positive_(?:int|float)')
    return [(name, flag) for name in SCRIPTS
            for flag in pattern.findall(open(os.path.join(BENCH_DIR, f"{name}.py")).read())]


def test_the_counts_are_found():
    assert ("bench_step", "--rounds") in count_flags() and ("bench_sample_index", "--repeats") in count_flags()
    assert ("bench_bf16_projection", "--peak-tflops") in count_flags() and ("bench_preprocess", "--size-mb") in count_flags()


@pytest.mark.parametrize("name,flag", count_flags())
def test_a_count_below_one_is_refused_in_one_line(monkeypatch, capsys, name, flag):
    refused_line(capsys, run_main(monkeypatch, name, flag, "0"), flag, "positive")


def test_cuda_checks_refuses_an_unknown_config_before_starting_a_worker(monkeypatch, capsys):
    refused_line(capsys, run_main(monkeypatch, "cuda_checks", "--only", "gpt", "nope"), "--only nope", "gpt_b")


@pytest.mark.parametrize("batch", ["3", "1"])
def test_parallel_efficiency_refuses_a_batch_dp2_cannot_split(monkeypatch, capsys, batch):
    # 3: DP=2 trained on 2 of the 3 sequences (an inflated efficiency); 1: empty batches on both ranks
    refused_line(capsys, run_main(monkeypatch, "bench_parallel_efficiency", "--global-batch-size", batch),
                 f"--global-batch-size {batch}", "multiple of 2")


def test_bench_zero_refuses_an_only_prefix_that_matches_no_strategy(monkeypatch, capsys):
    # before: nothing ran and two empty tables were printed, exit 0
    refused_line(capsys, run_main(monkeypatch, "bench_zero", "--only", "optim,zero3"), "--only zero3", "no_shard")


def test_bench_generate_refuses_a_device_it_cannot_run_on(monkeypatch, capsys):
    refused_line(capsys, run_main(monkeypatch, "bench_generate", "--device", "gpu"), "--device", "'gpu'")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    refused_line(capsys, run_main(monkeypatch, "bench_generate", "--device", "cuda"), "--device cuda", "--device cpu")


def test_bench_step_refuses_cuda_without_a_gpu(monkeypatch, capsys):
    # before: a traceback from torch.cuda.get_device_name() after the machine was described
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    refused_line(capsys, run_main(monkeypatch, "bench_step", "--device", "cuda"), "--device cuda", "--device cpu")


def test_bench_ckpt_removes_its_temporary_checkpoints_and_refuses_nothing_to_run(monkeypatch, capsys, tmp_path):
    from benchmarks import bench_ckpt

    refused_line(capsys, run_main(monkeypatch, "bench_ckpt", "--skip-async", "--only-async"), "--skip-async",
                 "--only-async")
    folders = []
    monkeypatch.setattr(bench_ckpt, "run", lambda args, out: folders.append((out, os.path.isdir(out))))
    bench_ckpt.main(["--layers", "1"])  # before: a mkdtemp folder of ~GBs of checkpoints was left behind
    bench_ckpt.main(["--layers", "1", "--out", str(tmp_path)])
    assert folders[0][1] and not os.path.exists(folders[0][0])
    assert folders[1] == (str(tmp_path), True) and tmp_path.is_dir()  # --out is the user's: kept


def test_bench_ckpt_stops_with_one_line_when_a_child_dies(monkeypatch, capsys, tmp_path):
    """A child that crashed (an exception in it, the OOM killer) left the parent waiting for its results
    forever (its peer, waiting for it, never reported either)."""
    from benchmarks import bench_ckpt

    monkeypatch.setattr(bench_ckpt, "save_load_rank", crashing_rank)
    with pytest.raises(SystemExit) as stop:
        bench_ckpt.main(["--layers", "1", "--skip-async", "--out", str(tmp_path)])
    assert stop.value.code == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "rank 1 of crashing_rank exited with code 7 before reporting its results" in line, line
    with pytest.raises(bench_ckpt.ChildFailed, match="reported no results within 2 s"):
        bench_ckpt.spawn(crashing_rank, [], "torch", str(tmp_path), world=1, timeout=2)


def test_bench_dist_checksums_runs_at_a_tiny_size(capsys):
    # before: the load of the checkpoint saved without CRC-32s was refused ('saved with checksums but
    # its checksums/ folder is missing'): removing the folder left common.pt's marker behind
    from benchmarks import bench_dist_checksums

    bench_dist_checksums.main(["--rounds", "1", "--hidden", "32", "--layers", "1"])
    out = capsys.readouterr().out
    assert "has no checksums (saved before they existed)" in out
    assert "save: with checksums" in out and "load: with checksums" in out


def test_bench_preprocess_builds_the_corpus_size_asked_for(tmp_path):
    from benchmarks.bench_preprocess import build_corpus

    docs = [f"document {i} " + "word " * 50 for i in range(200)]  # one pass: ~60 kB
    n, written = build_corpus(str(tmp_path / "c.jsonl"), 0.01, docs)
    assert 0.01 * 2**20 <= written < 0.01 * 2**20 + 400 and written == (tmp_path / "c.jsonl").stat().st_size
    assert n < 200  # before: the whole pass of 200 documents, six times the size asked for


def test_bench_step_refuses_quick_beside_another_shape(monkeypatch, capsys):
    # before: --quick won silently, and a '--device cuda --shape gpu --quick' run timed the CPU-sized model
    refused_line(capsys, run_main(monkeypatch, "bench_step", "--shape", "gpu", "--quick"), "--quick", "--shape gpu")


def probability_flags():
    pattern = re.compile(r'"(--[a-z0-9-]+)", type=probability')
    return [(name, flag) for name in SCRIPTS
            for flag in pattern.findall(open(os.path.join(BENCH_DIR, f"{name}.py")).read())]


def test_the_probabilities_are_found():
    assert ("bench_step", "--dropout") in probability_flags() and ("bench_dropout_mask", "--p") in probability_flags()


@pytest.mark.parametrize("name,flag", probability_flags())
@pytest.mark.parametrize("value", ["1", "-0.1"])
def test_a_dropout_rate_outside_0_1_is_refused_in_one_line(monkeypatch, capsys, name, flag, value):
    refused_line(capsys, run_main(monkeypatch, name, flag, value), flag, "[0, 1)")


def test_bench_gemm_layouts_every_layout_computes_the_same_product():
    from benchmarks.bench_gemm_layouts import variants

    cases = variants(tokens=10, k=6, n=7, dtype=torch.float64, blocks=3)
    joined = {key: torch.cat(out, dim=1 if "W's rows" in key[1] else 0) if isinstance(out, list) else out
              for key, fn in cases.items() for out in [fn()]}
    for kind in ("forward", "input grad", "weight grad"):
        ours = next(v for (k, layout), v in joined.items() if k == kind and "(ours)" in layout)
        others = [layout for (k, layout), v in joined.items() if k == kind and not torch.allclose(v, ours)]
        assert not others, (kind, others)


def test_bench_pipeline_formulas_match_the_equal_cost_simulation():
    from benchmarks.bench_pipeline import SCHEDULES, _formula_and_sim

    for name, _, _ in SCHEDULES:
        for m in (4, 8):
            formula, sim = _formula_and_sim(name, m)
            assert abs(formula - sim) < 0.01, (name, m, formula, sim)
    assert _formula_and_sim("1F1B", 4)[0] == 0.75


def test_bench_soak_classifies_each_way_a_launch_ends():
    from benchmarks.bench_soak import signature

    assert signature(0, "") == "ok"
    assert signature(None, "") == "hang (killed at the timeout)"
    assert signature(-6, "terminate called without an active exception\n").startswith("SIGABRT")
    assert signature(1, "  exitcode  : -6 (pid: 12)\n") == "worker exitcode : -6 (pid: 12)"
    assert signature(1, "nothing useful") == "torchrun exit 1"


@pytest.mark.parametrize("name,argv", [
    ("bench_batching", ["--requests", "2", "--max-requests", "2", "--max-num-batched-tokens", "64"]),
    ("bench_prefix", ["--requests", "2", "--system", "32", "--question", "8", "--turns", "2", "--message", "8",
                      "--answer", "4", "--max-requests", "2"]),
])
def test_the_serving_benchmarks_run_at_a_tiny_size(capsys, name, argv):
    # each checks itself that every mode gives the same tokens (else it exits with a message)
    module = importlib.import_module(f"benchmarks.{name}")
    tiny = ["--rounds", "1", "--layers", "1", "--hidden", "32", "--heads", "4", "--vocab", "128", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert module.main(argv + tiny) == 0
    finally:
        torch.set_num_threads(threads)  # main() sets the process's thread count
    out = capsys.readouterr().out
    assert "cpu: " in out and "same tokens" in out


@pytest.mark.parametrize("flag,value", [("--seq", "100"), ("--time-seq", "4")])
def test_bench_context_parallel_refuses_a_sequence_cp4_cannot_split(monkeypatch, capsys, flag, value):
    # before: the CP 1 run went through, then a worker died in a traceback ('not divisible by 2 x ...')
    refused_line(capsys, run_main(monkeypatch, "bench_context_parallel", flag, value), f"{flag} {value}",
                 "multiple of 8")


@pytest.mark.parametrize("tokens", ["10", "2"])
def test_bench_pipeline_refuses_tokens_it_cannot_cut_into_4_sequences(monkeypatch, capsys, tokens):
    # before: 10 ran 8 tokens and printed '10 tokens per micro-batch'; 2 ran sequences of length 0
    refused_line(capsys, run_main(monkeypatch, "bench_pipeline", "--tokens", tokens), f"--tokens {tokens}",
                 "multiple of 4")


def test_a_ratio_below_one_is_printed_the_other_way_round():
    from benchmarks.common import times_less

    assert times_less(3.27, 1.56, "shorter", "longer") == "2.10x shorter"
    assert times_less(1.35, 2.49, "shorter", "longer") == "1.84x longer"  # before: '0.54x shorter'
    assert times_less(32, 32, "fewer", "more") == "1.00x fewer"


def test_the_fusion_benchmark_refuses_a_bad_shape_in_one_line(monkeypatch, capsys):
    refused_line(capsys, run_main(monkeypatch, "bench_fusions", "--shapes", "32x100"), "--shapes", "multiple of 128")
    refused_line(capsys, run_main(monkeypatch, "bench_fusions", "--shapes", "big"), "--shapes", "ROWSxCOLS")


@pytest.mark.parametrize("dropout", ["0", "0.1"])
def test_bench_attention_runs_at_a_tiny_size_and_the_explicit_path_saves_more(capsys, dropout):
    from benchmarks import bench_attention

    threads = torch.get_num_threads()
    try:
        bench_attention.main(["--seqs", "32", "--tokens", "64", "--heads", "2", "--rounds", "1", "--threads", "1",
                              "--dtypes", "fp32", "--dropout", dropout])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    layer = "SDPA" if dropout == "0" else "cpu_core_attention"  # fp32 without dropout: the layer keeps SDPA
    assert f"| 32 x 2 | fp32 | {layer} | yes |" in out
    assert ("| SDPA |" in out) == (dropout == "0") and "| explicit |  |" in out
    # the explicit path keeps its seq x seq probabilities (and scores) for the backward; SDPA does not
    q, k, v = bench_attention.inputs(1, 2, 256, torch.float32)
    runs = bench_attention.paths(0.0, 0.125)
    assert bench_attention.saved_bytes(runs["explicit"], q, k, v) > bench_attention.saved_bytes(runs["SDPA"], q, k, v)


def test_bench_fp8_measures_every_recipe_given_side_by_side(monkeypatch, capsys):
    from benchmarks import bench_fp8

    monkeypatch.setattr(bench_fp8, "SMALL", dict(layers=1, hidden=128, heads=2, seq=128, batch=1, vocab=256))
    bench_fp8.main(["--steps", "1", "--fp8-recipe", "delayed", "blockwise", "mxfp8", "delayed"])
    out = capsys.readouterr().out
    gemm_header = next(line for line in out.splitlines() if line.startswith("gemm "))
    assert gemm_header.split()[-3:] == ["delayed", "blockwise", "mxfp8"]  # a repeated recipe runs once
    summary = out.split("summary:")[1]
    for name in ("delayed", "blockwise", "mxfp8"):
        assert f"fp8 {name} (bf16 params)" in out
        assert re.search(rf"{name} \d+\.\d\dx \(vs fp32 \d+\.\d\dx\)", summary), name
    assert out.count("> FP8 hybrid") == 3
