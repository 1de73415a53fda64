"""Every layout of a model on a cluster, estimated, fitting ones first, fastest first."""

from __future__ import annotations

from itertools import product

from ...errors import ConfigError
from ..model_state import SHARDING_STRATEGIES
from ..numbers import figure
from .estimate import RECOMPUTE, SCHEDULES, Estimate, Layout, check_layout, estimate
from .model import ClusterSpec, ModelSpec
from .split import SPLIT_FIELDS, SPLIT_FLAGS, check_split, layout_stages, split_ranges

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


def candidate_layouts(spec: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict | None = None,
                      refusals: list | None = None):
    """Every :class:`Layout` that passes :func:`check_layout`: TP a divisor of the node size, PP a
    divisor of the layer count or a power of two (uneven first and last stages), CP a power of two,
    EP a divisor of the experts, the experts' ETP the TP size or (at TP > 1) 1, the pipeline
    schedule 1F1B or (at PP > 1 with VPP 1) ZB-H1 (any VPP when fixed), hybrid-sharding
    instances 1 or one per node (:func:`_instance_choices`, sharded strategies only), the split of
    the layers from :func:`_split_choices`, the rest from the choices above. A fixed
    ``pipeline_layout`` (with any other split field it is refused, as in training) makes PP a divisor
    of its stage count and VPP the quotient.
    ``fixed`` (``{field: value}``, e.g. ``{"tp": 8}``) replaces a field's choices by that one value
    (any value: ``{"micro_batch": 3}`` is tried though 3 is not among the choices). ``refusals``
    collects the reason of each layout :func:`check_layout` refused."""
    fixed = dict(fixed or {})
    choices = dict(tp=_divisors(min(cluster.gpus_per_node, cluster.gpus)), pp=_pp_choices(spec.num_layers),
                   cp=CP_CHOICES, vpp=VPP_CHOICES, ep=_divisors(spec.num_experts) if spec.is_moe else [1],
                   micro_batch=MICRO_BATCHES, zero=SHARDING_STRATEGIES, recompute=RECOMPUTE)
    split = {k: fixed.pop(k) for k in SPLIT_FIELDS if k in fixed}
    moments = {"moment_bytes": fixed.pop("moment_bytes")} if "moment_bytes" in fixed else {}
    stages = layout_stages(split["pipeline_layout"]) if "pipeline_layout" in split else None
    if stages is not None:  # the layout's stage count is PP x VPP
        choices["pp"] = _divisors(stages)
    choices.update({k: [value] for k, value in fixed.items()})
    for t, p, cp in product(choices["tp"], choices["pp"], choices["cp"]):
        if cluster.gpus % (t * p * cp) and refusals is None:
            continue
        dp = max(1, cluster.gpus // (t * p * cp))
        instances = [fixed["instances"]] if "instances" in fixed else _instance_choices(cluster, t, cp, dp)
        etps = [fixed["etp"]] if "etp" in fixed else [None, 1] if spec.is_moe and t > 1 else [None]
        vpps = [max(1, stages // p)] if stages is not None and "vpp" not in fixed else choices["vpp"]
        for v, ep, b, zero, rc, n, etp in product(vpps, *(choices[k] for k in ("ep", "micro_batch", "zero", "recompute")),
                                                  instances, etps):
            if n > 1 and zero == "no_shard" and not {"instances", "zero"} <= fixed.keys():
                continue  # refused unless asked for both: else a fixed N's own refusal would hide behind it
            for schedule, how in product([fixed["schedule"]] if "schedule" in fixed else _schedule_choices(p, v),
                                         [split] if split else _split_choices(spec, p, v)):
                lay = Layout(tp=t, pp=p, dp=dp, cp=cp, ep=ep, vpp=v, zero=zero, recompute=rc, micro_batch=b,
                             instances=n, etp=etp, schedule=schedule, **how, **moments)
                try:
                    check_layout(spec, cluster, global_batch, lay)
                except ConfigError as err:
                    if refusals is not None:
                        refusals.append(str(err))
                    continue
                yield lay


def _split_choices(spec: ModelSpec, p: int, v: int) -> list[dict]:
    """The split naming no flags (even, or the planner's smaller first and last stages), and where PP x
    VPP does not divide the layers, the account flags whose accounted slots it divides (Megatron-LM's
    remedy for that case: the embedding or the loss counted as a layer) and that split otherwise."""
    layers, out, seen = spec.num_layers, [{}], set()
    if p == 1 or layers % (p * v) == 0:
        return out
    for e, s in ((False, False), (True, True), (False, True), (True, False)):
        if (e or s) and (layers + e + s) % (p * v):
            continue
        try:
            ranges = split_ranges(layers, spec.mtp_num_layers, p, v, (None, None, None, e, s))
        except ConfigError:
            continue
        if (e or s) and ranges not in seen:
            out.append({"account_embedding": e, "account_loss": s})
        seen.add(ranges)
    return out


def _schedule_choices(p: int, v: int) -> tuple[str, ...]:
    """ZB-H1 beside 1F1B where it differs from it: a pipeline (PP > 1) of one chunk per rank. Interleaved
    zero bubble (VPP > 1) is planned when asked for (``fixed["schedule"]``, --pipeline-schedule zb-h1),
    not searched by default (it would add a third to the search's layouts)."""
    return SCHEDULES if p > 1 and v == 1 else ("1f1b",)


def _instance_choices(cluster: ClusterSpec, t: int, cp: int, dp: int) -> list[int]:
    """Hybrid sharding choices: 1, and one instance per node when the DP x CP group spans several
    nodes (the sharding collectives then stay on NVLink, only the shard's all-reduce crosses nodes)."""
    nodes = t * cp * dp // cluster.gpus_per_node
    return [1, nodes] if nodes > 1 and dp * cp % nodes == 0 else [1]


def plan(spec: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict | None = None) -> list[Estimate]:
    """Estimates of every candidate layout: those that fit in memory first, each group by step time
    (then memory). With ``fixed`` values that no layout can take, one ConfigError saying why."""
    check_split(spec, fixed or {})
    refusals: list[str] = []
    layouts = candidate_layouts(spec, cluster, global_batch, fixed, refusals if fixed else None)
    estimates = [estimate(spec, cluster, global_batch, lay) for lay in layouts]
    if not estimates and not fixed:  # say why: the refusals of every layout, this time collected
        list(candidate_layouts(spec, cluster, global_batch, fixed, refusals))
    if not estimates and refusals:
        given = ", ".join(_FLAGS.get(k, k) + ("" if value is True else f" {value}") for k, value in (fixed or {}).items())
        product_errors = [r for r in refusals if "must equal --gpus" in r]  # the least telling reason
        reason = next((r for r in refusals if r not in product_errors), refusals[0])
        raise ConfigError(f"no layout{f' with {given}' if given else ''} can run this model on this cluster: {reason}")
    return sorted(estimates, key=lambda e: (not e.fits, e.step_s, e.memory_gb))


_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
          "vpp": "--virtual-pipeline-model-parallel-size", "cp": "--context-parallel-size",
          "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size", "micro_batch": "--micro-batch-size",
          "zero": "--data-parallel-sharding-strategy", "recompute": "--recompute-granularity",
          "instances": "--num-distributed-optimizer-instances", "schedule": "--pipeline-schedule",
          "moment_bytes": "bf16 moments (--use-precision-aware-optimizer), moment bytes", **SPLIT_FLAGS}


_PLAIN = "{}".format
COLUMNS = (("TP", "tp", _PLAIN), ("PP", "pp", _PLAIN), ("VPP", "vpp", _PLAIN), ("DP", "dp", _PLAIN), ("CP", "cp", _PLAIN),
           ("EP", "ep", _PLAIN), ("ETP", "etp", _PLAIN), ("sched", "schedule", _PLAIN), ("split", "split", _PLAIN),
           ("ZeRO", "zero", _PLAIN), ("inst", "instances", _PLAIN), ("recompute", "recompute", _PLAIN),
           ("mbs", "micro_batch", _PLAIN), ("mem GB", "mem_gb", figure), ("step s", "step_s", "{:.3g}".format),
           ("TFLOP/s/GPU", "tflops", figure), ("MFU", "mfu", lambda x: f"{figure(100 * x)}%"))


def format_table(estimates: list[Estimate]) -> str:
    """A fixed-width text table, one row per estimate (the ETP, schedule and split columns only where some
    layout sets ETP, runs ZB-H1 or splits the layers unevenly)."""
    shown = {"etp": any(e.layout.etp is not None for e in estimates),
             "schedule": any(e.layout.schedule != "1f1b" for e in estimates), "split": any(e.split for e in estimates)}
    columns = [c for c in COLUMNS if shown.get(c[1], True)]
    rows = [[fmt(e.row()[key]) for _, key, fmt in columns] for e in estimates]
    widths = [max([len(name)] + [len(r[i]) for r in rows]) for i, (name, _, _) in enumerate(columns)]
    lines = ["  ".join(name.rjust(w) for (name, _, _), w in zip(columns, widths))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
