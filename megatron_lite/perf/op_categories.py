"""Where a profiled step goes, by kind of work: GEMM, attention, elementwise, optimizer, copies,
communication (and other). Used by ``--profile --use-pytorch-profiler`` and benchmarks/bench_step.py.

Each profiler event's *self* time (time not spent in its children) is counted once, in the category
of the event or of its nearest categorised ancestor scope: everything under ``Optimizer.step`` (or
the training loop's ``optimizer_step`` scope) is optimizer work whatever the op, an op inside
``scaled_dot_product_attention`` is attention, a collective is communication wherever it runs.
Otherwise the op's own name decides. The own time of a graph Inductor compiled (``--torch-compile``:
its generated, fused kernels) counts as elementwise; the GEMMs it calls out to are GEMM.
"""

from __future__ import annotations

CATEGORIES = ("GEMM", "attention", "elementwise", "optimizer", "copies", "communication", "other")

_SCOPES = (  # (substring of an enclosing event's name, category): decides for everything inside it
    ("Optimizer.step", "optimizer"), ("optimizer_step", "optimizer"),
    ("scaled_dot_product", "attention"), ("flash_attention", "attention"), ("efficient_attention", "attention"),
    ("ring_attention", "attention"), ("flash_attn", "attention"),
)
_NAMES = (  # (substrings of an op's name, category), first match wins
    (("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "all_to_all", "alltoall", "broadcast",
      "c10d::", "gloo:", "nccl:", "isend", "irecv", "batch_isend_irecv", "record_param_comms", "barrier"), "communication"),
    (("_fused_adam", "_fused_sgd", "_foreach_", "adam"), "optimizer"),
    (("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_scaled_mm",
      "aten::_grouped_mm", "aten::addbmm", "mkldnn_", "onednn"), "GEMM"),
    (("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous", "aten::cat", "aten::stack",
      "aten::fill_", "aten::zero_", "aten::zeros", "aten::ones", "aten::full", "aten::index_put", "aten::scatter",
      "aten::gather", "aten::index", "aten::embedding", "aten::masked_fill", "aten::split", "aten::chunk",
      "aten::narrow", "aten::slice", "aten::empty", "aten::resize_"), "copies"),
    (("aten::", "CompiledFxGraph"), "elementwise"),  # every other ATen kernel (pointwise math, norms, softmax,
    # dropout, reductions) and Inductor's fused kernels
)


def category_of_name(name: str) -> str | None:
    """The category an op's name alone gives (``aten::mm`` -> GEMM), or None."""
    for keys, category in _NAMES:
        if any(k in name for k in keys):
            return category
    return None


def _scope_of(event) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        for key, category in _SCOPES:
            if key in parent.name:
                return category
        parent = parent.cpu_parent
    return None


def category_of(event) -> str:
    """The category an event's self time counts under (see the module docstring)."""
    name = event.name
    if category_of_name(name) == "communication":  # a collective counts as communication in any scope
        return "communication"
    for key, category in _SCOPES:
        if key in name:
            return category
    scope = _scope_of(event)
    if scope is not None:
        return scope
    return category_of_name(name) or "other"


def category_breakdown(events, device: bool = False) -> dict[str, float]:
    """Self time in seconds per category of ``events`` (``profile.events()``); ``device``: the
    accelerator's self time instead of the CPU's."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        us = getattr(event, "self_device_time_total", 0.0) if device else event.self_cpu_time_total
        if us:
            totals[category_of(event)] += us / 1e6
    return totals


def format_breakdown(totals: dict[str, float], title: str = "time by category") -> str:
    """A small table: seconds and share of the total per category."""
    total = sum(totals.values()) or 1.0
    lines = [f"{title}:", f"  {'category':<14} {'seconds':>9} {'share':>7}"]
    for category in CATEGORIES:
        lines.append(f"  {category:<14} {totals.get(category, 0.0):9.3f} {totals.get(category, 0.0) / total:7.1%}")
    return "\n".join(lines)
