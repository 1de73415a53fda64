"""--torch-compile: regional compile reproduces the eager run, and compiles each layer shape once.

One single-process run with Inductor (the real CPU backend: its first compile costs tens of seconds
of CPU, so it is the only one here), then the parallel layouts with the ``aot_eager`` backend (Dynamo
and AOTAutograd trace exactly as for Inductor; only the C++ code generation is skipped): TP 2 with
sequence parallelism, PP 2, EP 2 (MoE) and CP 2. Every run's losses and gradient norms equal the
single-process eager run's (fp32, rtol 1e-5), and Dynamo compiled the layer forward once per
distinct layer shape (its cache entries are counted on every rank). Full recomputation and the
FP8 GEMM seam run under compiled layers too.
"""

import pytest
import torch

import megatron_lite.fusions.jit as jit
import pretrain_gpt
from megatron_lite.fusions.compile import layer_cache_entries
from megatron_lite.models.transformer import TransformerLayer
from tests.cli_errors import refused_line
from tests.harness import run_ranks
from tests.trajectory import assert_same_trajectory, run_script

MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "123", "--make-vocab-size-divisible-by", "8", "--mock-data", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--lr", "1e-2", "--lr-warmup-iters", "2", "--clip-grad", "1.0", "--log-interval", "1",
    "--eval-iters", "0", "--seed", "7", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm",
]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-aux-loss-coeff", "1e-2", "--swiglu", "--disable-bias-linear"]
COMPILE = ["--torch-compile", "--torch-compile-backend"]


def compiled_rank(argv):
    """Inside a rank: a fresh Dynamo, train, and report (trajectory, layer compiles, graph breaks)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    trajectory = run_script("pretrain_gpt", argv)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return trajectory, layer_cache_entries(TransformerLayer._forward), breaks


@pytest.fixture(scope="module")
def eager():
    return {"dense": run_script("pretrain_gpt", MODEL), "moe": run_script("pretrain_gpt", MODEL + MOE)}


def test_inductor_single_process_reproduces_eager(eager):
    trajectory, compiles, breaks = compiled_rank(MODEL + COMPILE + ["inductor"])
    assert_same_trajectory(trajectory, eager["dense"], what="inductor")
    assert compiles == 1 and breaks == 0  # four layers, one shape: one compile, each layer one graph


@pytest.mark.parametrize("name, model, extra", [
    ("tp2_sp", "dense", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2", "dense", ["--pipeline-model-parallel-size", "2"]),
    ("ep2", "moe", ["--expert-model-parallel-size", "2"]),
    ("cp2", "dense", ["--context-parallel-size", "2"]),
])
def test_parallel_compiled_runs_reproduce_eager(eager, name, model, extra):
    argv = MODEL + (MOE if model == "moe" else []) + extra + COMPILE + ["aot_eager"]
    results = run_ranks(2, compiled_rank, argv)
    last = [t for t, _, _ in results if t.losses]
    assert last, "no rank reported losses"
    for trajectory in last:
        assert_same_trajectory(trajectory, eager[model], what=name)
    assert [c for _, c, _ in results] == [1, 1], f"{name}: layer compiles per rank"
    if name == "pp2":  # no collective inside a layer: whole-layer graphs
        assert [b for _, _, b in results] == [0, 0]


def deferred_rank(argv):
    """Inside a rank: (eager trajectory, compiled trajectory, GEMMs deferred to W eagerly, compiled)."""
    from megatron_lite.parallel.pipeline import wgrad

    counts, original = [0], wgrad.WeightGradStore.defer

    def counting(store, fn):
        counts[0] += 1
        original(store, fn)

    wgrad.WeightGradStore.defer = counting
    try:
        eager_run = run_script("pretrain_gpt", argv)
        eager_count, counts[0] = counts[0], 0
        compiled, _, _ = compiled_rank(argv + COMPILE + ["aot_eager"])
        return eager_run, compiled, eager_count, counts[0]
    finally:
        wgrad.WeightGradStore.defer = original


def test_zero_bubble_defers_the_compiled_layers_weight_gradients():
    """ZB-H1 with compiled layers: the layers' GEMMs run eagerly (graph breaks), so their weight
    gradients are still deferred to W, as many as in the eager ZB-H1 run (traced, the backward computed
    them at once: the schedule ran as 1F1B with only the output layer deferred), on its trajectory."""
    argv = MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--train-iters", "3"]
    for eager_run, compiled, eager_count, compiled_count in run_ranks(2, deferred_rank, argv):
        assert eager_count >= 3 * 2 * 8  # steps x micro-batches x (4 GEMMs x 2 layers), + the output layer's
        assert compiled_count == eager_count
        if compiled.losses:
            assert_same_trajectory(compiled, eager_run, what="zb-h1 compiled")


def test_recompute_with_compiled_layers(eager):
    """Full recomputation runs the compiled forward without grad (forward) and with it (recomputed
    in backward): one graph each, and the same trajectory."""
    argv = MODEL + ["--recompute-granularity", "full", "--recompute-method", "uniform"] + COMPILE + ["aot_eager"]
    trajectory, compiles, breaks = compiled_rank(argv)
    assert_same_trajectory(trajectory, eager["dense"], what="recompute")
    assert compiles == 2 and breaks == 0


def test_fp8_gemms_run_eagerly_inside_compiled_layers():
    """The FP8 GEMM seam (scaling state updated in Python) stays eager between compiled pieces: the
    compiled FP8 run follows the eager FP8 run (the same GEMMs on the same inputs: equal to fp32
    rounding, in practice bit for bit), one layer compile; FP8 GEMMs are slow on CPU, so 2 layers, 3 steps."""
    argv = MODEL + ["--num-layers", "2", "--bf16", "--fp8-format", "hybrid", "--train-iters", "3"]
    eager_fp8 = run_script("pretrain_gpt", argv)
    trajectory, compiles, breaks = compiled_rank(argv + COMPILE + ["aot_eager"])
    assert_same_trajectory(trajectory, eager_fp8, what="fp8")
    assert compiles == 1 and breaks > 0  # the GEMMs are graph breaks


def test_dropout_in_compiled_layers_draws_the_eager_masks():
    """With dropout, a compiled run draws the masks the eager run draws (PyTorch's generator, the same
    draws in the same order: the CPU attention with dropout runs eagerly inside the compiled layer),
    so it follows the eager trajectory."""
    argv = MODEL + ["--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--train-iters", "4"]
    eager_run = run_script("pretrain_gpt", argv)
    trajectory, compiles, _ = compiled_rank(argv + COMPILE + ["aot_eager"])
    assert_same_trajectory(trajectory, eager_run, what="dropout")
    assert compiles == 1


def test_jit_fuser_eager_keeps_the_loss_eager_and_says_so(eager, capsys):
    """--torch-compile with --jit-fuser eager: the layers are compiled (once), the loss's fused pieces
    run eagerly (never compiled), the start-up line says both, and the run follows the eager one."""
    from megatron_lite.parallel import cross_entropy

    cross_entropy.fused_shard_softmax._compiled.clear()
    trajectory, compiles, _ = compiled_rank(MODEL + COMPILE + ["aot_eager", "--jit-fuser", "eager"])
    assert_same_trajectory(trajectory, eager["dense"], what="--jit-fuser eager")
    assert compiles == 1 and not cross_entropy.fused_shard_softmax._compiled
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("> --torch-compile")]
    assert len(lines) == 1 and "compiled: the transformer layers" in lines[0] and "eager: the loss" in lines[0], lines


def test_inductor_on_a_cpu_without_a_cxx_compiler_is_refused_in_one_line(monkeypatch, capsys):
    """Inductor's CPU backend builds C++: without a compiler --torch-compile stopped at the first step
    with Inductor's traceback (exit 1); it is refused before the model is built (exit 2), naming the
    flag and the aot_eager backend, which needs no compiler and still runs."""
    monkeypatch.setattr(jit.shutil, "which", lambda name: None)  # no g++, c++ or clang++ on this "machine"
    monkeypatch.delenv("CXX", raising=False)
    jit.compile_unavailable.cache_clear()
    try:
        argv = MODEL + ["--num-layers", "1", "--train-iters", "3", "--torch-compile"]
        refused_line(capsys, lambda: pretrain_gpt.main(argv), "--torch-compile", "no working C++ compiler", "aot_eager")
        torch._dynamo.reset()
        assert len(run_script("pretrain_gpt", argv + ["--torch-compile-backend", "aot_eager"]).losses) == 3
    finally:
        jit.compile_unavailable.cache_clear()
