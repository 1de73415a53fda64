"""Every layout of a model on a cluster, estimated, fitting ones first, fastest first."""

from __future__ import annotations

from itertools import product

from ...errors import ConfigError
from ..model_state import SHARDING_STRATEGIES
from ..numbers import figure
from .estimate import RECOMPUTE, Estimate, Layout, check_layout, estimate
from .model import ClusterSpec, ModelSpec

MICRO_BATCHES = (1, 2, 4, 8)
VPP_CHOICES = (1, 2, 4)
CP_CHOICES = (1, 2, 4, 8, 16)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pp_choices(num_layers: int) -> list[int]:
    """The divisors of the layer count, and the powers of two below it (their first and last stages
    smaller, when that splits: :func:`~.model.stage_layers`)."""
    powers = [2**i for i in range(1, num_layers.bit_length()) if num_layers % 2**i]
    return sorted(set(_divisors(num_layers) + powers))


def candidate_layouts(spec: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict | None = None):
    """Every :class:`Layout` that passes :func:`check_layout`: TP a divisor of the node size, PP a
    divisor of the layer count or a power of two (uneven first and last stages), CP a power of two,
    EP a divisor of the experts, the rest from the choices above.
    ``fixed`` (``{field: value}``, e.g. ``{"tp": 8}``) keeps only the layouts with those values."""
    fixed = fixed or {}
    tps = _divisors(min(cluster.gpus_per_node, cluster.gpus))
    eps = _divisors(spec.num_experts) if spec.is_moe else [1]
    for t, p, cp in product(tps, _pp_choices(spec.num_layers), CP_CHOICES):
        if cluster.gpus % (t * p * cp):
            continue
        dp = cluster.gpus // (t * p * cp)
        for v, ep, b, zero, rc in product(VPP_CHOICES, eps, MICRO_BATCHES, SHARDING_STRATEGIES, RECOMPUTE):
            lay = Layout(tp=t, pp=p, dp=dp, cp=cp, ep=ep, vpp=v, zero=zero, recompute=rc, micro_batch=b)
            if any(getattr(lay, k) != value for k, value in fixed.items()):
                continue
            try:
                check_layout(spec, cluster, global_batch, lay)
            except ConfigError:
                continue
            yield lay


def plan(spec: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict | None = None) -> list[Estimate]:
    """Estimates of every candidate layout: those that fit in memory first, each group by step time
    (then memory)."""
    layouts = candidate_layouts(spec, cluster, global_batch, fixed)
    estimates = [estimate(spec, cluster, global_batch, lay) for lay in layouts]
    return sorted(estimates, key=lambda e: (not e.fits, e.step_s, e.memory_gb))


_PLAIN = "{}".format
COLUMNS = (("TP", "tp", _PLAIN), ("PP", "pp", _PLAIN), ("VPP", "vpp", _PLAIN), ("DP", "dp", _PLAIN), ("CP", "cp", _PLAIN),
           ("EP", "ep", _PLAIN), ("ZeRO", "zero", _PLAIN), ("recompute", "recompute", _PLAIN),
           ("mbs", "micro_batch", _PLAIN), ("mem GB", "mem_gb", figure), ("step s", "step_s", "{:.3g}".format),
           ("TFLOP/s/GPU", "tflops", figure), ("MFU", "mfu", lambda x: f"{figure(100 * x)}%"))


def format_table(estimates: list[Estimate]) -> str:
    """A fixed-width text table, one row per estimate."""
    rows = [[fmt(e.row()[key]) for _, key, fmt in COLUMNS] for e in estimates]
    widths = [max([len(name)] + [len(r[i]) for r in rows]) for i, (name, _, _) in enumerate(COLUMNS)]
    lines = ["  ".join(name.rjust(w) for (name, _, _), w in zip(COLUMNS, widths))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
