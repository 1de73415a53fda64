"""The planner against published Megatron runs: throughput within 20 %, and every layout fits.

Rows of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM"), Table 1: GPT models on DGX A100 80GB nodes (8 GPUs, 312 TFLOP/s bf16/fp16 peak),
sequence 2048, vocabulary 51,200, full activation recomputation, no optimizer sharding; the
achieved TFLOP/s per GPU counts the recomputed forward (the 96·B·s·l·h² form). The last row is the
paper's end-to-end estimate for GPT-3 175B (1024 GPUs, batch 1536, 140 TFLOP/s per GPU), whose
layout the paper does not give: TP 8 x PP 16 is assumed here.

Every row is estimated with the same constants (``MATMUL_EFFICIENCY``, ``RESERVED_BYTES``, the
A100 preset) and a micro-batch of 1, the non-interleaved schedule; the estimated TFLOP/s per GPU
must lie within 20 % of the published figure and the memory estimate within 80 GB.
"""

import pytest

from megatron_lite.perf.plan import CLUSTER_PRESETS, ClusterSpec, Layout, ModelSpec, estimate, stage_params

# billions of parameters, heads, hidden, layers, TP, PP, GPUs, global batch, published TFLOP/s per GPU
NARAYANAN_2021 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    (175.0, 96, 12288, 96, 8, 16, 1024, 1536, 140),  # GPT-3; layout assumed (module docstring)
]


def _published(row):
    billions, heads, hidden, layers, tp, pp, gpus, batch, tflops = row
    spec = ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=2048,
                     vocab_size=51200)
    layout = Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), recompute="full", micro_batch=1)
    return spec, ClusterSpec(gpus=gpus, **CLUSTER_PRESETS["a100"]), batch, layout


@pytest.mark.parametrize("row", NARAYANAN_2021, ids=lambda r: f"{r[0]}B")
def test_estimated_throughput_within_20_percent_and_fits(row):
    spec, cluster, batch, layout = _published(row)
    est = estimate(spec, cluster, batch, layout)
    assert abs(est.tflops_per_gpu / row[-1] - 1) <= 0.20, f"estimated {est.tflops_per_gpu:.1f}, published {row[-1]}"
    assert est.fits and est.memory_gb <= 80, f"estimated {est.memory_gb:.1f} GB"


@pytest.mark.parametrize("row", NARAYANAN_2021[:-1], ids=lambda r: f"{r[0]}B")
def test_parameter_count_matches_the_table(row):
    spec = _published(row)[0]
    dense, expert = stage_params(spec, 1, 1, 1, True, True)
    assert round((dense + expert) / 1e9, 1) == row[0]  # the table's one-decimal billions
