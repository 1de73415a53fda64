"""The parallel-layout planner: memory per GPU and step time of every TP/PP/VPP/DP/CP/EP, ZeRO,
recomputation and micro-batch layout of a model on a cluster, from the formulas of
:mod:`megatron_lite.perf` (``tools/plan.py`` is its command line)."""

from .estimate import MATMUL_EFFICIENCY, RESERVED_BYTES, Estimate, Layout, check_layout, estimate
from .model import (
           CLUSTER_PRESETS,
           MODEL_PRESETS,
           ClusterSpec,
           ModelSpec,
           active_params,
           stage_layers,
           stage_params,
)
from .search import candidate_layouts, format_table, plan

__all__ = ["CLUSTER_PRESETS", "MATMUL_EFFICIENCY", "MODEL_PRESETS", "RESERVED_BYTES", "ClusterSpec", "Estimate",
           "Layout", "ModelSpec", "active_params", "candidate_layouts", "check_layout", "estimate", "format_table", "plan",
           "stage_layers", "stage_params"]
