"""pretrain_gpt.py with --pipeline-schedule zb-h1 reproduces the single-process run.

Same pattern as test_pretrain_gpt.py: fp32, dropout 0, same seed and global batch (4 micro-batches
per data-parallel rank); every step's loss and gradient norm within a relative 1e-5 of the single-process run and
the final merged weights within rtol 1e-5. The layouts cover the deferred weight gradients under
tensor and sequence parallelism (sharded GEMM inputs and weights), data parallelism with the
gradient reduction overlapped in small buckets (the grad-ready hooks must fire after the W passes)
the distributed optimizer (reduce-scatter of the same buckets) and activation recomputation (the
recomputed forward runs inside B, so its GEMMs' weight gradients are deferred too), at pipeline
sizes 2 and 4.
"""

import pytest

from tests.e2e.test_pretrain_gpt import MODEL, MODEL_B, _one_line_exit_2, _parallel, _same_weights, _single
from tests.trajectory import assert_same_trajectory

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
    ],
)
def test_zb_h1_reproduces_single_process(tmp_path, reference, name, world, variant, extra):
    ref, ref_save = reference[variant]
    got, save = _parallel(tmp_path, name, world, 6, (MODEL_B if variant == "B" else []) + ZB + extra)
    assert_same_trajectory(got, ref, steps=6)
    _same_weights(save, ref_save)


def test_zb_h1_with_virtual_stages_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    _one_line_exit_2(capsys, MODEL + ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "2",
                                      "--num-layers-per-virtual-pipeline-stage", "1"] + ZB,
                     "--pipeline-schedule zb-h1", "--num-layers-per-virtual-pipeline-stage")
