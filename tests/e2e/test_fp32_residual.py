"""--fp32-residual-connection through the CLI: a bf16 run whose residual stream (and what crosses pipeline
stages) is fp32 gives the one-process trajectory at TP2 + SP x PP2 x CP2 with full recomputation, on 8 ranks.

One run covers the boundaries the stream crosses: the sequence-parallel shards (norms and residual adds on
them), the pipeline's p2p buffers (fp32 with the flag: a 16-bit buffer would refuse the fp32 tensor), the
context-parallel split and the recomputed layers. Tolerances are the bf16 ones of tests/e2e/test_fp8.py
(losses relative 1e-3, gradient norms GRAD_RTOL): what remains is bf16 rounding in other summation orders.
"""

from tests.e2e.test_fp8 import GRAD_RTOL
from tests.e2e.test_pretrain_gpt import _argv
from tests.trajectory import assert_same_trajectory, ranks_trajectory, run_script

ITERS = 6
FLAGS = ["--bf16", "--fp32-residual-connection"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
          "--context-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform"]


def test_fp32_residual_tp2_sp_pp2_cp2_recompute_follows_one_process(tmp_path):
    one = run_script("pretrain_gpt", _argv(str(tmp_path / "one"), ITERS, FLAGS))
    got = ranks_trajectory(8, "pretrain_gpt", _argv(str(tmp_path / "eight"), ITERS, FLAGS + LAYOUT))
    assert_same_trajectory(got, one, rtol=1e-3, grad_rtol=GRAD_RTOL, steps=ITERS, what="TP2+SP x PP2 x CP2, recompute")
