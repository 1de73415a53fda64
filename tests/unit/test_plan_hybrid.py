"""The layout planner's hybrid sharding (--num-distributed-optimizer-instances): the model state and
traffic it prices, the layouts it searches (one instance per node) and refuses, and tools/plan.py's
table and one-line refusals. The rest of the planner: test_plan.py."""

import os
import sys

import pytest
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.perf.model_state import model_state_bytes_per_param
from megatron_lite.perf.plan import Layout, check_layout, estimate, plan, stage_params, volumes
from tests.unit.test_plan import CLUSTER, GB, SPEC

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tools import plan as plan_tool  # noqa: E402


def test_hybrid_sharding_prices_the_instance_and_the_replicas():
    """--num-distributed-optimizer-instances N: model state at the strategy's bytes over d/N ranks; the
    strategy's collectives inside an instance (8 ranks: one node, NVLink) plus one all-reduce a step of
    the fp32 gradient shard over the N instances (across nodes)."""
    params = sum(stage_params(SPEC, 1, 1, 1, True, True))
    for zero in ("optim", "optim_grads", "optim_grads_params"):
        flat = estimate(SPEC, CLUSTER, 64, Layout(dp=16, zero=zero))
        hsdp = estimate(SPEC, CLUSTER, 64, Layout(dp=16, zero=zero, instances=2))
        assert hsdp.model_state_gb * GB == pytest.approx(float(model_state_bytes_per_param(torch.bfloat16, zero, 8)) * params)
        assert hsdp.model_state_gb > flat.model_state_gb
        m = hsdp.num_microbatches
        inner = volumes.dp_bytes(params, zero, 8, m) / (CLUSTER.intra_node_gbps * 1e9)
        cross = volumes.replica_bytes(params, 8, 2) / (CLUSTER.inter_node_gbps * 1e9)
        assert hsdp.comm_s["dp"] == pytest.approx(inner + cross)
        assert flat.comm_s["dp"] == pytest.approx(volumes.dp_bytes(params, zero, 16, m) / (CLUSTER.inter_node_gbps * 1e9))
        assert hsdp.comm_s["dp"] < flat.comm_s["dp"], zero  # only the shard crosses the slow network
    assert volumes.replica_bytes(1000, 8, 2) == 2 * 1 / 2 * 4000 / 8 and volumes.replica_bytes(1000, 8, 1) == 0


def test_hybrid_sharding_is_searched_one_instance_per_node_and_refused_where_it_cannot_run():
    found = {(e.layout.zero, e.layout.instances) for e in plan(SPEC, CLUSTER, 64, {"tp": 1, "pp": 1, "cp": 1})}
    assert ("optim_grads_params", 2) in found and ("optim", 2) in found and ("no_shard", 2) not in found
    assert {n for _, n in found} == {1, 2}  # DP 16 spans 2 nodes of 8
    for lay, match in [(Layout(dp=16, instances=2), "needs a sharded --data-parallel-sharding-strategy"),
                       (Layout(dp=16, zero="optim", instances=3), "instances 3 must divide DP 16")]:
        with pytest.raises(ConfigError, match=match):
            check_layout(SPEC, CLUSTER, 64, lay)
    check_layout(SPEC, CLUSTER, 64, Layout(dp=2, cp=8, zero="optim", instances=4))  # N divides DP x CP, as Megatron
    found = {(e.layout.dp, e.layout.instances) for e in plan(SPEC, CLUSTER, 64, {"tp": 1, "pp": 1, "cp": 16})}
    assert found == {(1, 1), (1, 2)}  # DP 1 x CP 16 spans 2 nodes: one instance per node


def test_tool_plans_and_refuses_hybrid_sharding(capsys):
    argv = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
            "--vocab-size", "32000", "--gpus", "16", "--global-batch-size", "64", "--top", "2",
            "--data-parallel-sharding-strategy", "optim_grads_params"]
    assert plan_tool.main(argv + ["--num-distributed-optimizer-instances", "2"]) == 0
    out = capsys.readouterr().out
    assert "inst" in out.splitlines()[2] and "ZeRO optim_grads_params in 2 instances (hybrid)" in out, out
    assert plan_tool.main(argv + ["--num-distributed-optimizer-instances", "3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--num-distributed-optimizer-instances 3" in lines[0], lines


def test_tool_refuses_a_non_dividing_instance_count_for_that_reason(capsys):
    """--num-distributed-optimizer-instances 3 at DP 16, strategy left to the search: the one-line refusal
    says 3 does not divide DP (it said the strategy must be sharded, from the no_shard layouts the user
    never asked for); no_shard asked for with 2 instances is still refused for that."""
    argv = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
            "--vocab-size", "32000", "--gpus", "16", "--global-batch-size", "64", "--top", "2"]
    assert plan_tool.main(argv + ["--num-distributed-optimizer-instances", "3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--num-distributed-optimizer-instances 3 must divide DP" in lines[0], lines
    assert "sharded" not in lines[0], lines
    no_shard = ["--data-parallel-sharding-strategy", "no_shard", "--num-distributed-optimizer-instances", "2"]
    assert plan_tool.main(argv + no_shard) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs a sharded --data-parallel-sharding-strategy" in lines[0], lines
