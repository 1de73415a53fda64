"""``benchmarks/bench_step.py``'s figures: MFU against the highest GEMM peak read during the run, and
each run against its baseline paired round by round (not the ratio of the two medians)."""

from benchmarks.bench_step import best_peaks, paired_ratios, time_runs


def test_mfu_is_against_the_highest_peak_read_during_the_run():
    samples = [{"fp32": 250e9, "bf16": 700e9}, {"fp32": 240e9, "bf16": 1660e9}, {"fp32": 260e9, "bf16": 640e9}]
    assert best_peaks(samples) == {"fp32": 260e9, "bf16": 1660e9}


def test_runs_are_compared_with_their_baseline_round_by_round():
    # medians: ours 2.0 vs HF 4.0 (2.00x), but round by round 3.0, 1.5 and 1.6: median 1.60x
    times = {"ours bf16": [1.0, 2.0, 2.5], "HF bf16 autocast": [3.0, 3.0, 4.0], "ours fp8": [1.5, 2.0, 2.5]}
    dtypes = {"ours bf16": "bf16", "HF bf16 autocast": "bf16", "ours fp8": "fp8"}
    lines = paired_ratios(times, dtypes)
    assert lines == ["ours bf16 vs HF bf16 autocast, paired by round: 1.60x (rounds 1.50-3.00x)",
                     "ours fp8 step / ours bf16 step, paired by round: 1.00x (rounds 1.00-1.50x)"]


def test_a_run_without_a_baseline_is_left_out():
    assert paired_ratios({"ours fp32": [1.0, 1.1]}, {"ours fp32": "fp32"}) == []


def test_the_peaks_are_read_again_after_every_round():
    calls = []
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times, cpu = time_runs(steps, rounds=3, warmup=1, after_round=lambda: calls.append("peak"))
    assert calls == ["a", "b", "a", "b", "peak", "b", "a", "peak", "a", "b", "peak"]
    assert [len(times[n]) for n in "ab"] == [3, 3] and [len(cpu[n]) for n in "ab"] == [3, 3]


def test_the_explicit_softmax_run_is_compared_with_ours_fused():
    # --unfused-softmax: ours with --no-masked-softmax-fusion, paired round by round as --unfused is
    times = {"ours bf16": [1.0, 2.0, 2.0], "ours bf16 unfused-softmax": [0.9, 1.8, 2.2]}
    dtypes = dict.fromkeys(times, "bf16")
    assert paired_ratios(times, dtypes) == [
        "ours bf16 vs ours bf16 unfused-softmax, paired by round: 0.90x (rounds 0.90-1.10x)"]


def test_the_explicit_softmax_run_is_planned_with_its_flag(monkeypatch):
    from benchmarks import bench_step

    built = []
    monkeypatch.setattr(bench_step, "build_ours", lambda shape, dropout, flags: built.append(flags) or (None, None))
    args = bench_step.parse(["--no-hf", "--unfused-softmax", "--dtypes", "bf16"])
    runs = bench_step.plan_runs(args, bench_step.SHAPES["quick"], {"fp32": 1.0, "bf16": 2.0})
    assert [name for name, _, _ in runs] == ["ours bf16", "ours bf16 unfused-softmax"]
    for _, _, build in runs:
        build()
    assert built == [["--bf16"], ["--bf16", "--no-masked-softmax-fusion"]]


def test_the_sdpa_run_leaves_attention_to_sdpa_while_it_steps(monkeypatch):
    from benchmarks import bench_step
    from megatron_lite.models import attention

    rule, seen = attention.beats_cpu_sdpa, []
    step = bench_step.sdpa_only(lambda: seen.append(attention.beats_cpu_sdpa(None, None, None, True)))
    step()
    assert seen == [False] and attention.beats_cpu_sdpa is rule  # restored after the step
    monkeypatch.setattr(bench_step, "build_ours", lambda shape, dropout, flags: (lambda: None, None))
    args = bench_step.parse(["--no-hf", "--sdpa", "--dtypes", "bf16"])
    runs = bench_step.plan_runs(args, bench_step.SHAPES["quick"], {"fp32": 1.0, "bf16": 2.0})
    assert [name for name, _, _ in runs] == ["ours bf16", "ours bf16 sdpa"]
    times = {"ours bf16": [1.0, 1.0], "ours bf16 sdpa": [1.2, 1.4]}
    assert paired_ratios(times, dict.fromkeys(times, "bf16")) == [
        "ours bf16 vs ours bf16 sdpa, paired by round: 1.30x (rounds 1.20-1.40x)"]
