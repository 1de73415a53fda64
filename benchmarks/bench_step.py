"""One training step, ours vs Hugging Face GPT-2, fp32 and bf16, eager and with --torch-compile.

The config of issue 21: 6 layers, hidden 768, 12 heads, seq 512, vocab 32768, batch 4 (``--quick``:
2 layers, hidden 256, 4 heads, seq 128, vocab 8192, batch 2, for a loaded machine). Ours is the
real training step of pretrain_gpt.py (``train_step``: the data-parallel gradient buffer, the
fused AdamW with fp32 masters, clipping, Megatron's default fusion flags) built from its command
line; Hugging Face is ``GPT2LMHeadModel`` (SDPA attention, tanh GeLU like ours, tied embeddings,
dropout as ours) with ``torch.optim.AdamW`` at its defaults (a per-tensor loop on CPU;
``--hf-fused-adamw`` gives it the fused kernel ours uses), and ``torch.autocast("cpu", bfloat16)`` for its bf16
row. All runs live in this one process and alternate round by round (A B C D, D C B A, ...), so
machine drift hits them alike; each run is also compared with its baseline round by round (the median
of the per-round ratios). MFU is model FLOPs (Narayanan's formula) per second over the GEMM peak of
that dtype measured in the same run (n x n products, best of several, measured again after every
round; the highest counts): both peaks are printed, and on a CPU without fast bf16 (bf16 peak below fp32's) the bf16 targets cannot be judged
there, which the report says; the full-size bf16 rows are then skipped unless ``--dtypes`` asks.

    python benchmarks/bench_step.py [--quick] [--rounds 5] [--threads 2] [--compile] [--profile]
    python benchmarks/bench_step.py --device cuda --shape gpu --dtypes fp32 bf16 fp8 --compile

On a GPU (``--device cuda``) both sides run there, each step ends with a synchronise, the GEMM
peaks are 8192-cubed products (fp32 without TF32, as the runs), and ``--shape gpu`` gives a model
large enough that kernel launches do not dominate the step.

Each step's process CPU time is reported next to its wall time: on a loaded machine the wall time
mostly measures waiting for a core, and the CPU-time ratio is the steadier figure (the lead reruns on
a quiet machine). ``--profile`` adds torch.profiler's breakdown of one step of each run by category (GEMM, attention,
elementwise, optimizer, copies, communication). ``--unfused`` adds ours with the ``jit_fuser`` fusions off
and the same math (``--no-bias-gelu-fusion --openai-gelu --no-bias-swiglu-fusion --no-bias-dropout-fusion
--no-rope-fusion``), compared round by round with ours fused; ``--unfused-softmax`` likewise adds ours with
``--no-masked-softmax-fusion`` (the explicit scale/mask/softmax attention; the fused one is SDPA, or with
attention dropout on a CPU ``cpu_core_attention``: ``--dropout 0`` compares SDPA); ``--sdpa`` likewise adds ours with attention without dropout left to
SDPA where ``cpu_core_attention`` would take it (short causal 16-bit attention on some CPUs); ``--swiglu`` gives ours a SwiGLU MLP
(Hugging Face's GPT-2 keeps its GeLU: compare with ``--no-hf``). Needs ``pip install transformers``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int, probability, timed  # noqa: E402
from megatron_lite.perf.flops import num_floating_point_operations  # noqa: E402
from megatron_lite.perf.host_memory import minor_page_faults  # noqa: E402
from megatron_lite.perf.matmul_peak import measure_matmul_peak  # noqa: E402
from megatron_lite.perf.op_categories import category_breakdown, format_breakdown  # noqa: E402
from megatron_lite.training.profiler import FAULTS_NOTE  # noqa: E402

SHAPES = {
    "issue": dict(layers=6, hidden=768, heads=12, seq=512, vocab=32768, batch=4),
    "quick": dict(layers=2, hidden=256, heads=4, seq=128, vocab=8192, batch=2),
    # a GPU-sized model (0.5B parameters) whose step is long enough for launch overheads not to dominate
    "gpu": dict(layers=8, hidden=2048, heads=16, seq=2048, vocab=50304, batch=4),
    # so small that a step is all per-operator dispatch (Python, autograd, the framework): what a GPU
    # step is made of when its kernels are short
    "overhead": dict(layers=6, hidden=64, heads=4, seq=32, vocab=512, batch=1),
}
FLAGS = {"fp32": [], "bf16": ["--bf16"], "fp8": ["--bf16", "--fp8-format", "hybrid"]}
UNFUSED = ["--no-bias-gelu-fusion", "--openai-gelu", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
           "--no-rope-fusion"]  # the jit_fuser fusions off, the same math (the tanh GeLU)
UNFUSED_SUFFIXES = (" unfused", " unfused-softmax", " sdpa")  # runs compared round by round with "ours <dtype>"


def ours_argv(shape: dict, dropout: float, extra=()) -> list[str]:
    return [
        "--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
        "--num-attention-heads", str(shape["heads"]), "--seq-length", str(shape["seq"]),
        "--vocab-size", str(shape["vocab"]), "--micro-batch-size", str(shape["batch"]),
        "--global-batch-size", str(shape["batch"]), "--mock-data", "--train-iters", "100000", "--eval-iters", "0",
        "--log-interval", "1000000", "--attention-dropout", str(dropout), "--hidden-dropout", str(dropout),
        "--lr", "1e-4", *extra,
    ]


def build_ours(shape: dict, dropout: float, extra=()):
    """Our training step (pretrain_gpt.py's pieces) as a no-argument function, and its config."""
    import pretrain_gpt
    from megatron_lite.arguments import parse_args
    from megatron_lite.fusions.compile import configure_compilation
    from megatron_lite.training.loop import _build, setup
    from megatron_lite.training.step import pipe_comm, train_step

    config = parse_args(ours_argv(shape, dropout, extra), world_size=1)
    tokenizer = pretrain_gpt.build_tokenizer_for(config)
    pretrain_gpt.set_vocab(config, tokenizer)
    state, device = setup(config)
    built = _build(config, state, device, pretrain_gpt.model_provider)
    train_iter, _ = pretrain_gpt.make_datasets_provider(tokenizer)(config, state, 0, 0)
    comm = pipe_comm(config, state)

    def step():
        configure_compilation(config.fusion, device.type)  # the jit_fuser mode is process-wide: each run sets its own
        train_step(config, comm, built.chunks, built.optimizer, built.scheduler, pretrain_gpt.forward_step, train_iter)

    return step, config


def sdpa_only(step):
    """``step`` with attention without dropout left to SDPA on a CPU (``beats_cpu_sdpa`` off while it runs)."""
    from megatron_lite.models import attention

    def run():
        rule, attention.beats_cpu_sdpa = attention.beats_cpu_sdpa, lambda *args: False
        try:
            step()
        finally:
            attention.beats_cpu_sdpa = rule

    return run


def build_hf(shape: dict, dropout: float, bf16: bool, fused_adamw: bool = False, device: str = "cpu"):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=shape["vocab"], n_positions=shape["seq"], n_embd=shape["hidden"], n_layer=shape["layers"],
                     n_head=shape["heads"], n_inner=4 * shape["hidden"], resid_pdrop=dropout, embd_pdrop=dropout,
                     attn_pdrop=dropout, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused_adamw or None)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)

    def step():
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def model_flops(shape: dict) -> float:
    """Model FLOPs of one training step at ``shape`` (Narayanan's formula, as MFU uses)."""
    from megatron_lite.models import TransformerConfig

    model = TransformerConfig(num_layers=shape["layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                              seq_length=shape["seq"], vocab_size=shape["vocab"])
    return num_floating_point_operations(model, shape["batch"])


def gemm_peaks(device: str) -> dict[str, float]:
    """fp32 and bf16 GEMM FLOP/s here; on a CPU bf16 is first probed at n=512 (it may be emulated and
    slow), and where it is fast, the best of n = 2048 and 3072: a CPU's bf16 matrix units were seen
    reaching their pace at one size and not the other, in the same minute (674 vs 1662 GFLOP/s)."""
    if device != "cpu":  # a GPU: n large enough to reach the tensor cores' pace (fp32 without TF32)
        return {"fp32": measure_matmul_peak(n=8192, device=device),
                "bf16": measure_matmul_peak(n=8192, dtype=torch.bfloat16, device=device)}
    peaks = {"fp32": measure_matmul_peak(n=2048)}
    bf16 = measure_matmul_peak(n=512, dtype=torch.bfloat16, warmup=1, reps=3)
    if bf16 > 0.5 * peaks["fp32"]:  # fast bf16: measure at full size
        bf16 = max(measure_matmul_peak(n=n, dtype=torch.bfloat16, reps=5) for n in (2048, 3072))
    peaks["bf16"] = bf16
    return peaks


def best_peaks(samples: list[dict[str, float]]) -> dict[str, float]:
    """The highest GEMM rate of each dtype over the run's measurements (MFU is against it: the pace the
    machine showed it can reach, not what it happened to give at one moment)."""
    return {k: max(s[k] for s in samples) for k in samples[0]}


def plan_runs(args, shape, peaks) -> list[tuple[str, str, object]]:
    """(name, dtype, builder) of every run, in the order of the first round. An FP8 run is ours with
    FP8 linears (bf16 elsewhere); it is compared with our bf16 step and its MFU is against the bf16 peak."""
    dtypes = args.dtypes or (["fp32", "bf16"] if peaks["bf16"] > peaks["fp32"] else ["fp32"])
    host = (["--no-retain-host-memory"] if args.no_retain_host_memory else []) + (["--swiglu"] if args.swiglu else [])
    runs = []
    for dtype in dtypes:
        bf16 = dtype != "fp32"
        runs.append((f"ours {dtype}", dtype, lambda f=FLAGS[dtype] + host: build_ours(shape, args.dropout, f)[0]))
        if args.unfused:
            runs.append((f"ours {dtype} unfused", dtype,
                         lambda f=FLAGS[dtype] + host + UNFUSED: build_ours(shape, args.dropout, f)[0]))
        if args.unfused_softmax:
            explicit = FLAGS[dtype] + host + ["--no-masked-softmax-fusion"]
            runs.append((f"ours {dtype} unfused-softmax", dtype, lambda f=explicit: build_ours(shape, args.dropout, f)[0]))
        if args.sdpa:
            runs.append((f"ours {dtype} sdpa", dtype,
                         lambda f=FLAGS[dtype] + host: sdpa_only(build_ours(shape, args.dropout, f)[0])))
        if not args.no_hf and dtype != "fp8":
            runs.append((f"HF {dtype}" + (" autocast" if bf16 else ""), dtype,
                         lambda b=bf16: build_hf(shape, args.dropout, b, args.hf_fused_adamw, args.device)))
        if args.compile:
            runs.append((f"ours {dtype} --torch-compile", dtype,
                         lambda f=FLAGS[dtype] + host: build_ours(shape, args.dropout, f + ["--torch-compile"])[0]))
    return runs


def time_runs(steps: dict, rounds: int, warmup: int, device: str = "cpu",
              after_round=lambda: None) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and process CPU seconds of every step, per run (on a GPU each step ends synchronised);
    ``after_round`` is called after each round (the GEMM peaks are measured again there)."""
    if device != "cpu":
        steps = {name: (lambda f=f: (f(), torch.cuda.synchronize())) for name, f in steps.items()}
    for name in list(steps):
        try:
            for _ in range(warmup):
                steps[name]()
        except RuntimeError as err:  # one run failing (an unsupported kernel, say) leaves the others
            print(f"{name}: dropped, its warm-up failed: {str(err).splitlines()[0][:300]}", flush=True)
            del steps[name]
    names = list(steps)
    times, cpu = {name: [] for name in names}, {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.process_time()
            times[name].append(timed(steps[name]))
            cpu[name].append(time.process_time() - start)
        print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in names), flush=True)
        after_round()
    return times, cpu


def _baseline_name(names, dtypes: dict, dtype: str) -> str | None:
    """The run a run of ``dtype`` is compared with: Hugging Face's, and for FP8 our bf16 step."""
    if dtype == "fp8":
        return "ours bf16" if "ours bf16" in names else None
    return next((n for n in names if n.startswith("HF") and dtypes[n] == dtype), None)


def _baseline(values: dict, dtypes: dict, dtype: str):
    """The median step of :func:`_baseline_name`'s run."""
    name = _baseline_name(values, dtypes, dtype)
    return statistics.median(values[name]) if name else None


def paired_ratios(times: dict, dtypes: dict) -> list[str]:
    """Each of our runs against its baseline round by round (the two steps of a round ran a minute
    apart at most, so a drifting machine moves both): the median of the per-round ratios and their
    range; a speed-up over Hugging Face, and for FP8 its step time over our bf16 step's (the target's form)."""
    lines = []
    for name, t in times.items():
        fused = next((name[:-len(s)] for s in UNFUSED_SUFFIXES if name.endswith(s)), None)
        if fused in times:  # ours fused vs ours unfused (or with the explicit softmax)
            ratios = [u / f for u, f in zip(t, times[fused], strict=True)]
            lines.append(f"{fused} vs {name}, paired by round: {statistics.median(ratios):.2f}x "
                         f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x)")
        base = _baseline_name(times, dtypes, dtypes[name])
        if name.startswith("HF") or base is None or base == name:
            continue
        if dtypes[name] == "fp8":  # the FP8 target is a ratio of step times: FP8's over bf16's
            ratios, label = [a / b for a, b in zip(t, times[base], strict=True)], f"{name} step / {base} step"
        else:  # the others are speed-ups: the baseline's step over ours
            ratios, label = [b / a for a, b in zip(t, times[base], strict=True)], f"{name} vs {base}"
        lines.append(f"{label}, paired by round: {statistics.median(ratios):.2f}x "
                     f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x)")
    return lines


PEAK_OF = {"fp32": "fp32", "bf16": "bf16", "fp8": "bf16"}


def report(times, cpu, dtypes, flops, peaks) -> None:
    """The table. CPU seconds per step (all threads) is the figure to read on a loaded machine, where
    wall time mostly measures waiting for a core."""
    print("\n| run | step (median) | vs HF same dtype (FP8: ours bf16) | CPU s per step (median) | vs HF, CPU time | "
          "MFU vs that dtype's GEMM peak (FP8: bf16's) |\n|---|---|---|---|---|---|")
    for name, t in times.items():
        med, cpu_med = statistics.median(t), statistics.median(cpu[name])
        hf, hf_cpu = _baseline(times, dtypes, dtypes[name]), _baseline(cpu, dtypes, dtypes[name])
        ours = not name.startswith("HF")
        ratio = f"{hf / med:.2f}x" if hf and ours else "-"
        cpu_ratio = f"{hf_cpu / cpu_med:.2f}x" if hf_cpu and ours else "-"
        print(f"| {name} | {med * 1e3:.0f} ms (min {min(t) * 1e3:.0f}) | {ratio} | {cpu_med:.2f} | {cpu_ratio} | "
              f"{flops / med / peaks[PEAK_OF[dtypes[name]]]:.0%} |")


def profile_runs(steps: dict, device: str = "cpu") -> None:
    """One step of each run under torch.profiler: time by category, and our runs' top operators (on a
    GPU by the GPU's self time, with the CPU's beside it: a gap between them is launch overhead or a sync)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    for name, step in steps.items():
        faults = minor_page_faults()
        with profile(activities=activities) as prof:
            step()
            if gpu:
                torch.cuda.synchronize()
        faults = minor_page_faults() - faults
        title = f"{name}: one step, self {'GPU' if gpu else 'CPU'} time by category"
        print("\n" + format_breakdown(category_breakdown(prof.events(), device=gpu), title))
        if not gpu:
            print(f"  {faults} minor page faults in this step ({FAULTS_NOTE})")
        if name.startswith("ours"):
            sort = "self_device_time_total" if gpu else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=40))


def parse(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="issue", help="issue: the issue's config (default); "
                   "quick: 2 layers, hidden 256, seq 128; gpu: 8 layers, hidden 2048, seq 2048, vocab 50304; "
                   "overhead: 6 layers, hidden 64, seq 32 (a step of dispatch only)")
    p.add_argument("--quick", action="store_true", help="same as --shape quick")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides run (cuda: one GPU)")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each run first (compiles happen here)")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16", "fp8"],
                   help="default: fp32, and bf16 where it is fast; fp8 is ours only (FP8 linears, bf16 elsewhere)")
    p.add_argument("--compile", action="store_true", help="also ours with --torch-compile (Inductor)")
    p.add_argument("--no-hf", action="store_true", help="only our runs")
    p.add_argument("--hf-fused-adamw", action="store_true",
                   help="HF with torch.optim.AdamW(fused=True) (default: AdamW's defaults, a per-tensor loop on CPU)")
    p.add_argument("--profile", action="store_true", help="per-category breakdown of one step of each run")
    p.add_argument("--unfused", action="store_true",
                   help="also ours with the jit_fuser fusions off (the same math), compared with ours fused")
    p.add_argument("--unfused-softmax", action="store_true",
                   help="also ours with --no-masked-softmax-fusion (the explicit scale/mask/softmax attention), "
                   "compared with ours fused")
    p.add_argument("--sdpa", action="store_true",
                   help="also ours with attention left to SDPA where cpu_core_attention would take it without "
                   "dropout (beats_cpu_sdpa), compared with ours")
    p.add_argument("--swiglu", action="store_true", help="ours with a SwiGLU MLP (HF keeps GeLU: use --no-hf)")
    p.add_argument("--no-retain-host-memory", action="store_true",
                   help="run ours with --no-retain-host-memory: the whole process (HF too) keeps glibc's defaults; "
                   "without it, our set-up makes glibc keep freed memory for every run in this process")
    args = p.parse_args(argv)
    if args.quick and args.shape not in ("issue", "quick"):
        p.error(f"--quick with --shape {args.shape}: --quick is --shape quick; give one of them")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible to torch here (run with --device cpu)")
    return args


def main(argv=None):
    args = parse(argv)
    os.environ["MEGATRON_LITE_DEVICE"] = args.device  # our runs: the same device as Hugging Face's
    torch.set_num_threads(args.threads)
    shape = SHAPES["quick" if args.quick else args.shape]
    print(describe_machine(args.threads))
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()} (both sides run there)")
    print("config: " + ", ".join(f"{k} {v}" for k, v in shape.items()) + f", dropout {args.dropout}, AdamW")
    peaks = gemm_peaks(args.device)
    fast_bf16 = peaks["bf16"] > peaks["fp32"]
    print(f"GEMM peaks ({args.device}): fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} "
          f"GFLOP/s" + ("" if fast_bf16 else " -- no fast bf16 here: the bf16 targets cannot be judged here"))
    runs = plan_runs(args, shape, peaks)
    steps = {name: build() for name, _, build in runs}
    if args.device == "cpu":
        print("host memory: " + ("glibc's defaults (freed large blocks go back to the kernel)" if args.no_retain_host_memory
                                 else "kept for reuse in this process, for ours and HF alike (--retain-host-memory)"))
    dtypes = {name: dtype for name, dtype, _ in runs}
    flops = model_flops(shape)
    print(f"model FLOPs per step: {flops / 1e9:.1f} GFLOP")
    samples = [peaks]
    times, cpu = time_runs(steps, args.rounds, args.warmup, args.device,
                           after_round=lambda: samples.append(gemm_peaks(args.device)))
    peaks = best_peaks(samples)
    print(f"GEMM peaks over the run ({len(samples)} measurements, MFU is against the highest): " + ", ".join(
        f"{k} {min(s[k] for s in samples) / 1e9:.1f}-{peaks[k] / 1e9:.1f} GFLOP/s" for k in peaks))
    report(times, cpu, dtypes, flops, peaks)
    print("\n" + "\n".join(paired_ratios(times, dtypes)))
    if "ours fp8" in times and "ours bf16" in times:
        ratio = statistics.median(times["ours fp8"]) / statistics.median(times["ours bf16"])
        print(f"\nFP8 step / bf16 step: {ratio:.2f}x (target: within 1.3x)")
    if args.profile:
        profile_runs(steps, args.device)


if __name__ == "__main__":
    main()
