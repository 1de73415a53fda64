"""pretrain_gpt.py with --pipeline-schedule zb-h1 reproduces the single-process run.

Same pattern as test_pretrain_gpt.py: fp32, dropout 0, same seed and global batch (4 micro-batches
per data-parallel rank); every step's loss and gradient norm within a relative 1e-5 of the single-process run and
the final merged weights within rtol 1e-5. The layouts cover the deferred weight gradients under
tensor and sequence parallelism (sharded GEMM inputs and weights), data parallelism with the
gradient reduction overlapped in small buckets (the grad-ready hooks must fire after the W passes)
the distributed optimizer (reduce-scatter of the same buckets) and activation recomputation (the
recomputed forward runs inside B, so its GEMMs' weight gradients are deferred too), at pipeline
sizes 2 and 4; with virtual stages (interleaved zero bubble, two chunks per rank) under TP2 +
sequence parallelism with tied embeddings, and at DP2 with ZeRO-2 (sharded gradients: the W passes
reduce-scatter their own buckets, chunk by chunk).

With sharded data parallelism (ZeRO-2 ``optim_grads``, ZeRO-3 ``optim_grads_params``) at PP2 x DP2,
tied embeddings, ZB-H1 is compared with 1F1B under the same flags (it changes only the order of
work): losses and gradient norms within a relative 1e-6 every step and the final weights within
rtol 1e-6 (seen: bit for bit). ZeRO-2 runs without gradient-accumulation fusion or overlap, in
small buckets that mix deferred weights with norms; ZeRO-3 with fusion and overlapped reduction
and parameter gathers, and a ZB-H1 run stopped at step 3 and resumed continues the same trajectory
to the same weights.
"""

import pytest

from tests.e2e.test_pretrain_gpt import (
    MODEL_B,
    _argv,
    _parallel,
    _same_weights,
    _single,
)
from tests.trajectory import assert_same_trajectory, assert_same_weights, ranks_trajectories

ZB = ["--pipeline-schedule", "zb-h1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref_zb")
    return {variant: _single(tmp, f"single{variant}", 6, extra) for variant, extra in (("A", []), ("B", MODEL_B))}


@pytest.mark.parametrize(
    "name, world, variant, extra",
    [
        ("pp2", 2, "A", ["--pipeline-model-parallel-size", "2"]),
        ("pp4", 4, "B", ["--pipeline-model-parallel-size", "4"]),
        ("tp2_pp2_sp", 4, "B", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--sequence-parallel"]),
        ("pp2_dp2_overlap", 4, "A", ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce",
                                     "--ddp-bucket-size", "2000"]),
        ("pp2_dp2_distopt", 4, "B", ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                     "--overlap-grad-reduce", "--ddp-bucket-size", "3000"]),
        ("pp2_recompute_full", 2, "A", ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                                        "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
        ("pp2_recompute_selective", 2, "B", ["--pipeline-model-parallel-size", "2",
                                             "--recompute-granularity", "selective"]),
        # interleaved zero bubble: two chunks per rank (tied embeddings on chunk 0 of rank 0 and chunk 1 of rank 1)
        ("tp2_pp2_vpp2_sp", 4, "A", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel"]),
        ("pp2_vpp2_dp2_zero2", 4, "B", ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                        "1", "--data-parallel-sharding-strategy", "optim_grads",
                                        "--no-gradient-accumulation-fusion", "--ddp-bucket-size", "3000"]),
    ],
)
def test_zb_h1_reproduces_single_process(tmp_path, reference, name, world, variant, extra):
    ref, ref_save = reference[variant]
    got, save = _parallel(tmp_path, name, world, 6, (MODEL_B if variant == "B" else []) + ZB + extra)
    assert_same_trajectory(got, ref, steps=6)
    _same_weights(save, ref_save)


@pytest.mark.parametrize("name, flags, resume", [
    ("zero2", ["--data-parallel-sharding-strategy", "optim_grads", "--no-gradient-accumulation-fusion",
               "--ddp-bucket-size", "3000"], False),
    ("zero3_overlap", ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
                       "--overlap-param-gather"], True),
])
def test_zb_h1_with_sharded_data_parallel_equals_1f1b(tmp_path, name, flags, resume):
    iters, base = 6, ["--pipeline-model-parallel-size", "2"] + flags
    dirs = {k: str(tmp_path / f"{name}_{k}") for k in ("1f1b", "zb", "zb_stop", "zb_resumed")}
    argvs = [_argv(dirs["1f1b"], iters, base + ["--pipeline-schedule", "1f1b"]), _argv(dirs["zb"], iters, base + ZB)]
    if resume:
        argvs += [_argv(dirs["zb_stop"], iters, base + ZB + ["--exit-interval", "3"]),
                  _argv(dirs["zb_resumed"], iters, base + ZB + ["--load", dirs["zb_stop"]])]
    ref, got, *parts = ranks_trajectories(4, "pretrain_gpt", argvs)
    assert_same_trajectory(got, ref, rtol=1e-6, steps=iters, what="zb-h1 vs 1f1b")
    assert_same_weights(dirs["zb"], dirs["1f1b"], rtol=1e-6, atol=0.0, what="zb-h1 vs 1f1b")
    if resume:
        assert_same_trajectory(parts[0] + parts[1], got, rtol=1e-6, steps=iters, what="stopped at 3 and resumed")
        assert_same_weights(dirs["zb_resumed"], dirs["zb"], rtol=1e-6, atol=0.0, what="resumed")
