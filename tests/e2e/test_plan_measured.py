"""The planner's traffic against what folded MoE runs count: tools/plan.py's volumes equal --log-comm-volume.

pretrain_gpt.py trains a tiny MoE GPT (L=4 MoE layers, h=32, s=16, micro-batch b=2, global batch 8,
4 experts top-2, bf16, sequence parallelism) two steps on a folded expert grid, with the counter on:

- TP 2 x DP 2 with whole experts over ETP 1 x EP 4 (EP spans the TP ranks), no sharding;
- TP 2 x CP 2 with ETP 2 x EP 2 (EP spans the CP ranks), the distributed optimizer.

Every rank's every step is compared, per group kind, with :mod:`megatron_lite.perf.plan.volumes`
for the same shapes (``Layout`` as tools/plan.py builds it). The counter's ``tp`` + ``sp`` is the
planner's ``tp`` (with sequence parallelism its all-reduces are all-gathers and reduce-scatters, the
same bytes); the counter's ``ep`` holds the planner's ``ep`` and ``etp`` (the expert-TP gathers
are all-to-alls over the ETP group).

- tp + sp, cp, dp, pp: equal exactly, after adding what the planner does not price (a few bytes per
  token or per parameter, nothing per layer and hidden unit): the vocab-parallel cross entropy's two
  all-reduces of ``3 b s`` fp32 per micro-batch (tp) and, once a step, the all-reduce of the
  sequence-parallel parameters' gradients (the norms and the routers, sp).
- ep: the planner assumes uniform routing. The all-to-all bytes depend on where the router sent each
  token, so each rank records every dispatch's per-expert counts; the counted bytes must equal the
  closed form of that routing (:func:`_routed_rows`) exactly, and the same closed form at uniform
  routing must equal the planner's ``ep + etp`` plus what it does not price (each routed row's bf16
  routing weight travels with it, 2 bytes against the row's 2h). The per-expert counts' all-gather
  (int64, over EP then ETP) is the rest of ``ep``. The counted mean over the ranks lies within 10 %
  of the uniform figure (what this routing of 16-32 slots per rank and layer departs from it).
"""

from fractions import Fraction
from unittest import mock

import pytest

import pretrain_gpt
from megatron_lite.moe.dispatcher import AllToAllDispatcher
from megatron_lite.parallel.expert_grid import expert_coords
from megatron_lite.perf.comm_volume import CommVolume, ring_bytes
from megatron_lite.perf.plan import Layout, ModelSpec, stage_params, volumes
from tests.e2e.test_pretrain_gpt import _argv
from tests.harness import run_ranks

L, H, S, B, GB, E, K, STEPS = 4, 32, 16, 2, 8, 4, 2, 2
FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--ffn-hidden-size", "64", "--group-query-attention", "--num-query-groups", "2", "--num-experts", str(E),
         "--moe-router-topk", str(K), "--moe-token-dispatcher-type", "alltoall", "--bf16", "--sequence-parallel",
         "--tensor-model-parallel-size", "2", "--lr-warmup-iters", "0", "--log-comm-volume"]
SPEC = ModelSpec(num_layers=L, hidden_size=H, num_attention_heads=4, seq_length=S, vocab_size=123,
                 make_vocab_size_divisible_by=8, ffn_hidden_size=64, num_query_groups=2, swiglu=True,
                 add_bias_linear=False, learned_positions=False, normalization="RMSNorm", num_experts=E,
                 moe_router_topk=K)
ROW, WEIGHT, COUNT = 2 * H, 2, 8  # bytes of a routed bf16 row, its bf16 routing weight, an int64 expert count


def _measure(argv):
    """Inside a rank: every step's counts and every dispatch's per-expert token counts (forward order)."""
    routed, dispatch = [], AllToAllDispatcher.dispatch

    def spy(self, hidden, probs, routing_map):
        routed.append(routing_map.sum(dim=0).tolist())
        return dispatch(self, hidden, probs, routing_map)

    with mock.patch.object(AllToAllDispatcher, "dispatch", spy):
        result = pretrain_gpt.main(argv)
    return result.comm_volume, routed


def _routed_rows(counts, lay, rank):
    """Rows ``rank`` sends each way (forward, and again in backward) in one MoE layer's all-to-alls, given
    every rank's per-expert counts ``counts[r][e]``. R_out rows leave for other EP ranks (dispatch, and the combine's
    gradient), R_in come from them (combine, dispatch's gradient); ETP > 1 all-gathers the rows an
    expert-TP group received, ``recv``, (ETP-1) recv out, the peers' recv in, and reduce-scatters the
    outputs back, the same both ways. Bytes: each row twice (out and back, or back and out), its routing
    weight once (it rides the dispatch and the gather, its gradient their backward)."""
    world, etp, ep = len(counts), lay.expert_tp, lay.ep
    coords = [expert_coords(r, world, etp, ep) for r in range(world)]

    def peers(r, axis):  # ranks differing from r in ``axis`` only
        return [q for q in range(world) if all(coords[q][a] == coords[r][a] for a in ("etp", "ep", "edp") if a != axis)]

    def mine(r):  # the local experts of r's EP rank
        return slice(coords[r]["ep"] * E // ep, (coords[r]["ep"] + 1) * E // ep)

    def recv(r):
        return sum(sum(counts[q][mine(r)]) for q in peers(r, "ep"))

    r_out = sum(counts[rank]) - sum(counts[rank][mine(rank)])
    r_in = recv(rank) - sum(counts[rank][mine(rank)])
    g_out = (etp - 1) * recv(rank)
    g_in = sum(recv(q) for q in peers(rank, "etp") if q != rank)
    return r_out + r_in + g_out + g_in


def _unpriced_tp(lay, m):
    """Traffic the planner leaves out: the cross entropy's all-reduces (max; sum of exps and target logit)
    of [s, b] and [2, s, b] fp32 per micro-batch, and once a step the sequence-parallel parameters'
    gradients all-reduced over TP (two RMSNorms a layer, the final norm, each layer's E x h router)."""
    tokens = B * S // lay.cp
    cross_entropy = m * ring_bytes("all_reduce", 3 * tokens * 4, lay.tp)
    return cross_entropy + ring_bytes("all_reduce", ((2 * L + 1) * H + L * E * H) * 4, lay.tp)


@pytest.mark.parametrize("name, extra, lay", [
    ("tp2_dp2_etp1_ep4", ["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"],
     Layout(tp=2, dp=2, ep=4, etp=1, micro_batch=B)),
    ("tp2_cp2_etp2_ep2", ["--expert-model-parallel-size", "2", "--context-parallel-size", "2",
                          "--use-distributed-optimizer"], Layout(tp=2, cp=2, ep=2, zero="optim", micro_batch=B)),
])
def test_planner_volumes_equal_folded_runs_counts(tmp_path, name, extra, lay):
    m = GB // (lay.dp * lay.micro_batch)
    world = lay.gpus
    dense, expert = stage_params(SPEC, lay.tp, 1, lay.ep, True, True, etp=lay.etp)
    planned = {"tp": volumes.tp_bytes(SPEC, lay, m) + _unpriced_tp(lay, m), "cp": volumes.cp_bytes(SPEC, lay, m),
               "pp": volumes.pp_bytes(SPEC, lay, m),
               "dp": volumes.dp_bytes(dense, lay.zero, lay.dp * lay.cp, m) + volumes.dp_bytes(expert, lay.zero, lay.expert_dp, m)}
    calls = L * m  # dispatches per step
    slots = K * B * S // (lay.tp * lay.cp)  # routed slots of a rank's tokens per layer
    uniform = _routed_rows([[slots // E] * E] * world, lay, 0)
    assert calls * 2 * uniform * ROW == volumes.ep_bytes(SPEC, lay, m) + volumes.etp_bytes(SPEC, lay, m)
    metadata = (lay.ep - 1) * E * COUNT + (lay.expert_tp - 1) * lay.ep * E * COUNT  # over EP, then over ETP
    results = run_ranks(world, _measure, _argv(str(tmp_path / name), STEPS, FLAGS + extra))
    routed_total = 0
    for rank, (steps, _) in enumerate(results):
        assert len(steps) == STEPS
        for step, counts in enumerate(steps):
            kinds = CommVolume.per_kind(counts)
            got = {"tp": kinds["tp"] + kinds["sp"], "cp": kinds["cp"], "pp": kinds["pp"], "dp": kinds["dp"]}
            assert got == planned, f"rank {rank} step {step}: counted {got}, planned {planned}"
            routing = [[r[1][step * calls + c] for r in results] for c in range(calls)]
            routed = sum(_routed_rows(each, lay, rank) for each in routing) * (2 * ROW + WEIGHT)
            assert counts[("ep", "all_to_all")] == routed, f"rank {rank} step {step}"
            assert kinds["ep"] == routed + calls * metadata, f"rank {rank} step {step}: {counts}"
            routed_total += routed
    mean = Fraction(routed_total, world * STEPS)
    expected = calls * uniform * (2 * ROW + WEIGHT)
    assert abs(mean / expected - 1) < 0.10, (float(mean), expected)
