"""The profiler's per-category breakdown puts each op's self time where the docs say."""

from types import SimpleNamespace

import pytest

from megatron_lite.perf.op_categories import category_breakdown, category_of


def _event(name, parent=None, us=0.0):
    return SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=us)


@pytest.mark.parametrize("name, parent, category", [
    ("aten::mm", None, "GEMM"),
    ("aten::addmm", "forward", "GEMM"),
    ("aten::copy_", None, "copies"),
    ("aten::gelu", None, "elementwise"),
    ("## Call CompiledFxGraph fabc123 ##", None, "elementwise"),  # Inductor's fused kernels
    ("aten::mul", "Optimizer.step#AdamW.step", "optimizer"),  # any op inside the optimizer's step
    ("aten::_fused_adamw_", None, "optimizer"),
    ("aten::bmm", "aten::scaled_dot_product_attention", "attention"),  # inside attention: attention
    ("c10d::allreduce_", "optimizer_step", "communication"),  # a collective wins over its scope
    ("gloo:all_reduce", None, "communication"),
    ("cudaLaunchKernel", None, "other"),
])
def test_category_of(name, parent, category):
    scope = None if parent is None else _event(parent, _event("ProfilerStep#1"))
    assert category_of(_event(name, scope)) == category


def test_breakdown_sums_self_time_in_seconds():
    events = [_event("aten::mm", us=3e6), _event("aten::add", us=1e6), _event("aten::mm", us=2e6)]
    totals = category_breakdown(events)
    assert totals["GEMM"] == 5.0 and totals["elementwise"] == 1.0 and sum(totals.values()) == 6.0
