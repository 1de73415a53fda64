"""ZB-H1 on real gloo groups: the toy tensor-parallel stack of test_pipeline.py against the
single-process run (per-micro-batch losses and every gradient, fp32 rtol 1e-5 atol 1e-6), with
the recorded trace equal to :func:`order.order_zb_h1` (so each rank really ran F, B and W in
that order), W of each micro-batch after its B, data-parallel sync switched on only right before
the last W, and never more micro-batches in flight (forward done, W not yet) than 1F1B's bound p.

Equal numbers and a W in the trace do not show that the work was deferred (a W that computes
nothing, after a B that computed everything, gives both): hooks on every parameter record the op
during which its gradient changed. Under ZB-H1 each GEMM's weight gradient (and a column-parallel
bias, added by the GEMM) must change during W of micro-batch 0, 1, ..., m-1 and never during a B;
the row-parallel bias (added after the reduction, not deferred) during each B. Under 1F1B (the
control) everything changes during B.
"""

import pytest

from megatron_lite.parallel.pipeline.order import zb_interleaved_bound
from megatron_lite.parallel.pipeline.trace import peak_in_flight
from tests.distributed.test_pipeline import check_against_reference, check_trace, run_pipeline
from tests.harness import run_ranks


def _check_in_flight(results, pp):
    for res in results:
        ops = [(e.kind, e.microbatch, e.chunk) for e in res["trace"]]
        assert any(k == "W" for k, _, _ in ops)
        assert peak_in_flight(ops) <= pp


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 3)])
def test_zb_h1_matches_single_process(pp, m):
    results = run_ranks(pp, run_pipeline, 4, m, 1, pp, None, False, False, "zb-h1")
    check_against_reference(results, 4, m, pp)
    check_trace(results, m, pp)
    _check_in_flight(results, pp)


@pytest.mark.parametrize("sp", [False, True])
def test_zb_h1_with_tensor_parallel(sp):
    results = run_ranks(4, run_pipeline, 4, 4, 2, 2, None, sp, False, "zb-h1")
    check_against_reference(results, 4, 4, 2)
    check_trace(results, 4, 2)
    _check_in_flight(results, 2)


def test_zb_h1_with_data_parallel():
    results = run_ranks(4, run_pipeline, 4, 4, 1, 2, None, False, False, "zb-h1")
    check_against_reference(results, 4, 4, 2, dp=2)
    check_trace(results[:1] + results[2:3], 4, 2)


def _ops_per_param(result) -> dict:
    out: dict = {}
    for kind, mb, name in result["arrivals"]:
        out.setdefault(name, []).append((kind, mb))
    return out


@pytest.mark.parametrize("tp, sp", [(1, False), (2, True)])
@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_weight_gradients_arrive_in_w_not_in_b(schedule, tp, sp):
    m = 4
    results = run_ranks(2 * tp, run_pipeline, 4, m, tp, 2, None, sp, False, schedule, grad_arrivals=True)
    for res in results:
        ops = _ops_per_param(res)
        assert len(ops) == 2 * 4  # 2 layers per stage x (col weight, col bias, row weight, row bias)
        for name, seen in ops.items():
            deferred = schedule == "zb-h1" and not name.endswith("row.bias")
            expected = [("W" if deferred else "B", i) for i in range(m)]
            assert seen == expected, f"{schedule} rank {res['pp_rank']}: {name} changed during {seen}, expected {expected}"


def test_zb_h1_forward_only_is_plain_forwards():
    results = run_ranks(2, run_pipeline, 4, 4, 1, 2, None, False, True, "zb-h1")
    check_against_reference(results, 4, 4, 2, forward_only=True)
    check_trace(results, 4, 2, forward_only=True)


# Interleaved zero bubble (--pipeline-schedule zb-h1 with virtual stages): the same checks, the
# trace equal to :func:`order.order_zb_interleaved` and in flight never more than interleaved 1F1B's
# first rank holds.


def _check_interleaved_in_flight(results, pp, m, v):
    bound = zb_interleaved_bound(pp, m, v)
    for res in results:
        ops = [(e.kind, e.microbatch, e.chunk) for e in res["trace"]]
        assert sorted(op for op in ops if op[0] == "W") == sorted(("W", mb, c) for mb in range(m) for c in range(v))
        assert peak_in_flight(ops) <= bound


def test_interleaved_zero_bubble_matches_single_process():
    pp, m, layers = 4, 8, 8  # v = 2 chunks per rank
    results = run_ranks(pp, run_pipeline, layers, m, 1, pp, 1, False, False, "zb-h1")
    check_against_reference(results, layers, m, pp)
    check_trace(results, m, pp)
    _check_interleaved_in_flight(results, pp, m, layers // pp)


def test_interleaved_zero_bubble_with_tensor_parallel_and_deferred_weights():
    """TP2 + SP x PP2 x VP2, m = p (no steady phase): equal to one process, and every GEMM weight's
    gradient changes during W of micro-batch 0, 1, ... of its chunk, never during a B (the row bias
    during each B)."""
    m = 2
    results = run_ranks(4, run_pipeline, 4, m, 2, 2, 1, True, False, "zb-h1", grad_arrivals=True)
    check_against_reference(results, 4, m, 2)
    check_trace(results, m, 2)
    _check_interleaved_in_flight(results, 2, m, 2)
    for res in results:
        for name, seen in _ops_per_param(res).items():
            expected = [("B" if name.endswith("row.bias") else "W", i) for i in range(m)]
            assert seen == expected, f"rank {res['pp_rank']}: {name} changed during {seen}, expected {expected}"


def test_interleaved_zero_bubble_forward_only_is_interleaved_forwards():
    results = run_ranks(4, run_pipeline, 8, 8, 1, 4, 1, False, True, "zb-h1")
    check_against_reference(results, 8, 8, 4, forward_only=True)
    check_trace(results, 8, 4, forward_only=True)
