"""--log-comm-volume: the bytes each rank counts per step equal the closed-form volumes exactly.

pretrain_gpt.py (the small GPT of test_pretrain_gpt.py: L=4 layers, h=32, s=16, micro-batch b=2,
global batch 8, vocab padded to V=128, tied embeddings, fp32) runs 3 steps on every layout with
the counter on; every step of every rank must count exactly (as fractions) the ring volumes below
(n bytes over g ranks: all-reduce 2(g-1)/g n, all-gather / reduce-scatter (g-1)/g n, a
point-to-point send n), per group kind, and nothing else.

Per micro-batch, with A = s*b*h*4 bytes (one [s, b, h] fp32 activation):
- TP (g = t): forward all-reduces after the embedding and after each layer's attention and MLP
  (1 + 2L), backward all-reduces before each layer's QKV and first MLP GEMM and before the output
  layer (2L + 1): (4L + 2) all-reduces of A; plus the vocab-parallel cross entropy's two
  all-reduces of [s, b] and [2, s, b] fp32 (max; sum of exps and target logit).
- TP+SP: the same (4L + 2) collectives each become an all-gather plus a reduce-scatter
  (8L + 4 ops of (t-1)/t A, the same bytes), counted as sp; once per step the sequence-parallel
  parameters' gradients (both norms' weight and bias and the two row-parallel biases per layer,
  the final norm: (6L + 2) h floats, and the learned position embedding, s*h floats: it is added
  to each rank's sequence chunk, so each rank holds a partial gradient) are all-reduced over TP
  (sp); the cross entropy stays tp.
- DP (g = d), once per step: the gradient buffer (all P parameters, one bucket padded to a
  multiple of d) all-reduced, or with the distributed optimizer reduce-scattered and the updated
  parameters all-gathered.
- PP: each rank sends A per micro-batch for every stage boundary it feeds (1F1B and ZB-H1: one,
  forward from the first stage, backward from the last; interleaved with v=2 chunks at p=2: three);
  once per step the tied word-embedding gradient (V*h fp32) is all-reduced between the first and
  last stage (pp).
- CP (c = 2, ring attention): per layer and micro-batch the K/V buffer KV = 2·b·a·(s/c)·(h/a)·4
  bytes travels c-1 hops forward, c-1 in backward, and its gradient c hops: (3c-2)·KV (cp); the
  gradients are all-reduced over the DP x CP group (dp).
"""

from fractions import Fraction

import pytest

import pretrain_gpt
from megatron_lite.perf.comm_volume import CommVolume
from tests.e2e.test_pretrain_gpt import _argv
from tests.harness import run_ranks

L, H, S, B, V, GB = 4, 32, 16, 2, 128, 8
A = S * B * H * 4


def _params(t=1):
    """Parameters on one rank at TP size t: word embedding (sharded), position embedding, per layer
    two norms, QKV / fc1 (weights and biases sharded), projection / fc2 (weights sharded, biases
    not), the final norm."""
    layer = 4 * H + (3 * H * H + 3 * H) // t + H * H // t + H + (4 * H * H + 4 * H) // t + 4 * H * H // t + H
    return V * H // t + S * H + L * layer + 2 * H


PARAMS = _params()


def _volumes(argv):
    result = pretrain_gpt.main(argv)
    return [CommVolume.per_kind(step) for step in result.comm_volume]


def _ring(op, n, g):
    return Fraction(2 * (g - 1) * n, g) if op == "all_reduce" else Fraction((g - 1) * n, g)


def _tp(t, m, sp=False):
    ce = _ring("all_reduce", S * B * 4, t) + _ring("all_reduce", 2 * S * B * 4, t)
    act = (4 * L + 2) * _ring("all_reduce", A, t)
    out = {"tp": m * ce + (0 if sp else m * act)}
    if sp:
        out["sp"] = m * act + _ring("all_reduce", ((6 * L + 2) * H + S * H) * 4, t)
    return out


def _dp(d, distopt, params=PARAMS):
    padded = -(-params // d) * d * 4
    if distopt:
        return {"dp": _ring("reduce_scatter", padded, d) + _ring("all_gather", padded, d)}
    return {"dp": _ring("all_reduce", padded, d)}


def _pp(m, sends_per_microbatch):
    return {"pp": m * sends_per_microbatch * A + _ring("all_reduce", V * H * 4, 2)}



@pytest.mark.parametrize(
    "name, world, extra, expected",
    [
        ("tp2", 2, ["--tensor-model-parallel-size", "2"], lambda rank: _tp(2, 4)),
        ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], lambda rank: _tp(2, 4, sp=True)),
        ("dp2", 2, ["--overlap-grad-reduce"], lambda rank: _dp(2, False)),
        ("dp4_distopt", 4, ["--use-distributed-optimizer"], lambda rank: _dp(4, True)),
        ("pp2_1f1b", 2, ["--pipeline-model-parallel-size", "2"], lambda rank: _pp(4, 1)),
        ("pp2_zb", 2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"], lambda rank: _pp(4, 1)),
        ("pp2_interleaved", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
         lambda rank: _pp(4, 3)),
        ("cp2", 2, ["--context-parallel-size", "2"],
         lambda rank: {"cp": Fraction(4 * L * (3 * 2 - 2) * 2 * B * (S // 2) * H * 4), **_dp(2, False)}),
        ("tp2_dp2_sp", 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
         lambda rank: {**_tp(2, 2, sp=True), **_dp(2, False, _params(2))}),
    ],
)
def test_counted_bytes_equal_closed_forms(tmp_path, name, world, extra, expected):
    argv = _argv(str(tmp_path / name), 3, ["--log-comm-volume"] + extra)
    for rank, steps in enumerate(run_ranks(world, _volumes, argv)):
        assert len(steps) == 3
        want = {k: Fraction(0) for k in ("tp", "sp", "cp", "ep", "dp", "pp")}
        want.update(expected(rank))
        for step in steps:
            assert step == want, f"rank {rank}: counted {step}, closed form {want}"
