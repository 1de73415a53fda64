"""Memory per GPU and step time of one parallel layout, from the formulas of :mod:`megatron_lite.perf`.

Memory (bytes, the fullest pipeline stage; stage i of p holds the layers training's split gives
pipeline rank i, over its chunks: :func:`~.split.rank_ranges`, from the layout's split flags):

* model state: the stage's parameters (:func:`~.model.stage_params`) times the bytes per parameter
  of the sharding strategy (:func:`~megatron_lite.perf.model_state.model_state_bytes_per_param`,
  bf16 weights, fp32 gradients and Adam state, its moments in bf16 with ``--use-precision-aware-optimizer``
  ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``: sharded strategies only), dense weights sharded over DP x CP, expert
  weights (``E / EP`` experts split over ETP) over the expert-data-parallel ranks, DP x CP / EP, or
  TP x CP x DP / (ETP x EP) on a folded expert grid (:mod:`megatron_lite.parallel.expert_grid`);
* activations: Korthikanti et al.'s bytes per layer
  (:func:`~megatron_lite.perf.activation_memory.korthikanti_layer_bytes`, or
  :func:`~megatron_lite.perf.activation_memory.mla_layer_bytes` for multi-latent attention;
  sequence parallelism on whenever TP > 1, the sequence split over CP) times the layers of a stage
  (all its chunks) times the micro-batches in flight on stage i (:func:`in_flight_microbatches`, the schedule's
  warmup plus one: ``min(p - i, m)`` under 1F1B; interleaved with m > p, ``p + (p - 2i - 1)/v``
  stages' worth, ``p (1 + (p-1)/(p v))`` on the first stage and ``p - (p-1)/v`` on the last; ZB-H1
  ``min(p, m)`` on every stage: a micro-batch stays until its deferred weight gradients, counted as
  its whole activations; interleaved zero bubble the interleaved first stage's on every stage (the
  bound its order keeps); a rank whose chunks differ in size: the most layers its order holds at
  once, :func:`held_layers`). Full
  recomputation adds one layer's un-recomputed activations (the layer being recomputed). The last stage adds its MTP layers (one micro-batch) and fp32 logits,
  ``4 b (s/cp) V / t`` for the model and each MTP depth. The MLP is counted as a 4h GeLU MLP;
  other shapes (SwiGLU, experts) are approximated by it;
* plus :data:`RESERVED_BYTES` (CUDA context, communication buffers, allocator slack).

Step time: the hardware FLOPs of the step (:func:`~megatron_lite.perf.flops.num_floating_point_operations`,
with the recomputed forward under full recomputation, the recomputed Q·Kᵀ and probabilities·V
under selective recomputation) over the GPUs at :data:`MATMUL_EFFICIENCY`
of peak, times the busiest pipeline rank's share (:func:`~.split.busiest_share`: its FLOPs, layers
and on the last rank the output layer and MTP, over the mean rank's; 1 when balanced: the busiest
rank paces the pipeline); plus the tensor-, context-, expert-, expert-tensor- and pipeline-parallel traffic of one
GPU (:mod:`.volumes`) over the bandwidth of its group (inside a node or across nodes, from the rank
order TP, CP, DP, PP; the experts' ETP, EP, expert-DP); that sum stretched by the pipeline bubble
(:func:`pipeline_bubble`: ``(p-1)/(v m)`` under 1F1B, ``(p-1)/(3m)`` under ZB-H1 with m >= p,
``(p-1)/(3vm)`` interleaved with m >= 2p); plus the
data-parallel gradient and weight traffic. No communication is assumed hidden behind compute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

from ...errors import ConfigError
from ...parallel.expert_grid import expert_dp_size, folding_problem
from ...parallel.pipeline.order import rank_order, warmup_1f1b, warmup_interleaved, zb_interleaved_bound
from ...parallel.pipeline.trace import bubble_fraction, simulate
from ..activation_memory import korthikanti_layer_bytes, mla_layer_bytes
from ..flops import core_attention_flops, layer_windows, num_floating_point_operations
from ..model_state import SHARDING_STRATEGIES, model_state_bytes_per_param
from . import volumes
from .model import ClusterSpec, ModelSpec, stage_params
from .split import busiest_share, rank_layers, rank_ranges, split_label

MATMUL_EFFICIENCY = 0.55
"""Fraction of the peak matmul FLOP/s that a transformer layer's GEMMs reach on a large model (one
number for every layout and model; calibrated against published Megatron runs, see the tests)."""

RESERVED_BYTES = 4 * 2**30
"""Memory per GPU not available to model state and activations."""

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "zb-h1")
GB = 2**30


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    zero: str = "no_shard"
    recompute: str = "none"
    micro_batch: int = 1
    instances: int = 1  # --num-distributed-optimizer-instances: hybrid sharding (HSDP with ZeRO-2/3)
    etp: int | None = None  # --expert-tensor-parallel-size; None: TP
    schedule: str = "1f1b"  # --pipeline-schedule: 1f1b (interleaved when vpp > 1) or zb-h1
    # the split of the layers over the stages (training's flags; none named: even, or smaller first and last)
    pipeline_layout: str | None = None  # --pipeline-model-parallel-layout (its stage count / PP is the VPP)
    first: int | None = None  # --decoder-first-pipeline-num-layers
    last: int | None = None  # --decoder-last-pipeline-num-layers
    account_embedding: bool = False  # --account-for-embedding-in-pipeline-split
    account_loss: bool = False  # --account-for-loss-in-pipeline-split
    moment_bytes: int = 8  # Adam's two moments per element: 4 in bf16 (--use-precision-aware-optimizer)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Ranks of a stage holding the same expert shard (the rank grid's expert-DP x CP)."""
        return expert_dp_size(self.tp, self.cp, self.dp, self.ep, self.etp)


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    num_microbatches: int
    model_state_gb: float
    activation_gb: float
    memory_gb: float
    fits: bool
    compute_s: float
    comm_s: dict  # per group kind: tp, cp, ep, etp, pp, dp
    bubble: float
    busiest: float  # the busiest pipeline rank's FLOPs over the mean rank's (1: balanced)
    step_s: float
    tflops_per_gpu: float  # hardware FLOP/s per GPU (recomputation counted), as Narayanan et al. report it
    mfu: float  # model FLOPs (no recomputation) over the peak
    split: str = ""  # how the layers are split when not evenly (:func:`~.split.split_label`)

    def row(self) -> dict:
        out = asdict(self.layout)
        out.update(etp=self.layout.expert_tp, split=self.split, mem_gb=self.memory_gb, step_s=self.step_s, tflops=self.tflops_per_gpu, mfu=self.mfu)
        return out


def check_layout(spec: ModelSpec, cluster: ClusterSpec, global_batch: int, lay: Layout) -> None:
    """Raise ConfigError (one line) when ``lay`` cannot run ``spec`` on ``cluster``."""
    if lay.gpus != cluster.gpus:
        raise ConfigError(f"TP {lay.tp} x PP {lay.pp} x DP {lay.dp} x CP {lay.cp} = {lay.gpus} must equal --gpus {cluster.gpus}")
    if lay.tp > cluster.gpus_per_node or cluster.gpus_per_node % lay.tp:
        raise ConfigError(f"TP {lay.tp} must divide --gpus-per-node {cluster.gpus_per_node} (TP stays inside a node)")
    shared = spec.moe_shared_expert_intermediate_size if spec.is_moe else None  # split over TP, as training's
    for flag, value in (("--num-attention-heads", spec.num_attention_heads), ("--num-query-groups", spec.num_query_groups),
                        ("--ffn-hidden-size", spec.ffn_hidden_size), ("--moe-shared-expert-intermediate-size", shared)):
        if value is not None and value % lay.tp:
            raise ConfigError(f"TP {lay.tp} must divide {flag} {value}")
    rank_ranges(spec, lay)  # training's split of the layers (pipeline_ranges), or its one-line refusal
    # CP's 2 x cp chunks, then sequence parallelism (on with TP > 1) cuts a rank's seq / cp tokens over TP
    if lay.cp > 1 and spec.seq_length % (2 * lay.cp):
        raise ConfigError(f"--seq-length {spec.seq_length} must be divisible by 2 x CP {lay.cp}")
    if (spec.seq_length // lay.cp) % lay.tp:
        raise ConfigError(f"--seq-length {spec.seq_length}" + f" / CP {lay.cp}" * (lay.cp > 1)
                          + f" must be divisible by TP {lay.tp} (sequence parallelism)")
    if global_batch % (lay.dp * lay.micro_batch):
        raise ConfigError(f"--global-batch-size {global_batch} must be divisible by DP {lay.dp} x micro-batch {lay.micro_batch}")
    if lay.vpp > 1 and (lay.pp == 1 or global_batch // (lay.dp * lay.micro_batch) % lay.pp):
        raise ConfigError(f"VPP {lay.vpp} needs PP > 1 and the micro-batches per step divisible by PP {lay.pp}")
    if lay.schedule not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {lay.schedule}: one of {', '.join(SCHEDULES)}")
    _check_experts(spec, lay)
    if lay.moment_bytes != 8 and lay.zero == "no_shard":
        raise ConfigError("--use-precision-aware-optimizer needs the distributed optimizer: a sharded "
                          "--data-parallel-sharding-strategy")
    if lay.zero not in SHARDING_STRATEGIES or lay.recompute not in RECOMPUTE:
        raise ConfigError(f"ZeRO strategy {lay.zero!r} / recompute {lay.recompute!r} not one of "
                          f"{', '.join(SHARDING_STRATEGIES)} / {', '.join(RECOMPUTE)}")
    _check_instances(lay)


def _check_experts(spec: ModelSpec, lay: Layout) -> None:
    """EP and ETP: a mixture-of-experts model, and an expert grid ETP x EP that divides a stage's ranks."""
    if (lay.ep > 1 or lay.etp is not None) and not spec.is_moe:
        size = f"EP {lay.ep}" if lay.ep > 1 else f"ETP {lay.etp}"
        raise ConfigError(f"{size} needs a mixture-of-experts model (--num-experts)")
    if lay.ep > 1 and spec.num_experts % lay.ep:
        raise ConfigError(f"EP {lay.ep} must divide --num-experts {spec.num_experts}")
    if spec.is_moe and (spec.moe_ffn_hidden_size or spec.ffn_hidden_size) % lay.expert_tp:
        raise ConfigError(f"ETP {lay.expert_tp} must divide --moe-ffn-hidden-size "
                          f"{spec.moe_ffn_hidden_size or spec.ffn_hidden_size}")
    problem = folding_problem(lay.tp, lay.cp, lay.dp, lay.ep, lay.expert_tp)
    if problem:
        raise ConfigError(problem)


def _check_instances(lay: Layout) -> None:
    n = lay.instances
    if n < 1:
        raise ConfigError(f"--num-distributed-optimizer-instances {n} must be at least 1")
    if n > 1 and lay.zero == "no_shard":
        raise ConfigError(f"--num-distributed-optimizer-instances {n} needs a sharded --data-parallel-sharding-strategy "
                          "(optim, optim_grads or optim_grads_params), not no_shard")
    if (lay.dp * lay.cp) % n or lay.expert_dp % n:
        raise ConfigError(f"--num-distributed-optimizer-instances {n} must divide DP {lay.dp} x CP {lay.cp} and the "
                          f"expert data-parallel size {lay.expert_dp}")


def _bandwidth(cluster: ClusterSpec, stride: int, size: int) -> float:
    """Bytes/s per GPU of a group of ``size`` ranks ``stride`` apart: NVLink when it fits in one node."""
    gbps = cluster.intra_node_gbps if stride * size <= cluster.gpus_per_node else cluster.inter_node_gbps
    return gbps * 1e9


def layer_bytes(spec: ModelSpec, lay: Layout, recompute: str | None) -> float:
    """Activation bytes of one layer for one micro-batch (Korthikanti's formula, or its MLA form)."""
    s, t = spec.seq_length // lay.cp, lay.tp
    if spec.multi_latent_attention:
        return mla_layer_bytes(s, lay.micro_batch, spec.hidden_size, spec.num_attention_heads, t, t > 1, recompute,
                               spec.q_lora_rank, spec.kv_lora_rank, spec.qk_head_dim, spec.qk_pos_emb_head_dim,
                               spec.v_head_dim)
    return korthikanti_layer_bytes(s, lay.micro_batch, spec.hidden_size, spec.num_attention_heads, t, t > 1, recompute)


@lru_cache(maxsize=1024)
def in_flight_microbatches(p: int, i: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Micro-batches whose activations stage ``i`` of ``p`` holds at its peak under the schedule's
    order (:mod:`~megatron_lite.parallel.pipeline.order`): its warmup forwards plus the first steady
    one (all of them when there is no steady phase), over all ``v`` chunks, in whole-stage units.
    ZB-H1: ``min(p, m)`` on every stage (a micro-batch is held until its deferred W, whose stashed
    GEMM inputs and output gradients are counted as its whole activations); interleaved zero bubble:
    the bound its order keeps on every stage, interleaved 1F1B's first stage's (which its orders reach)."""
    if p == 1:
        return 1.0
    if schedule == "zb-h1":
        return float(min(p, m)) if v == 1 else zb_interleaved_bound(p, m, v) / v
    total = m * v
    warm = warmup_interleaved(p, i, m, v) if v > 1 else warmup_1f1b(p, i, m)
    return min(warm + 1, total) / v


@lru_cache(maxsize=1024)
def held_layers(p: int, i: int, m: int, sizes: tuple, schedule: str = "1f1b") -> int:
    """Most layers' activations rank ``i`` holds at once under the interleaved order, its chunks
    ``sizes`` layers each: a forward of chunk c adds its layers, that micro-batch's backward frees them
    (its W under zero bubble)."""
    live = peak = 0
    frees = "W" if schedule == "zb-h1" else "B"
    for kind, _, chunk in rank_order(p, i, m, len(sizes), schedule):
        live += sizes[chunk] if kind == "F" else -sizes[chunk] if kind == frees else 0
        peak = max(peak, live)
    return peak


def memory_bytes(spec: ModelSpec, lay: Layout, m: int) -> tuple[float, float]:
    """``(model state, activations)`` bytes on the fullest pipeline stage (module docstring)."""
    return max(stage_memory(spec, lay, m), key=sum)


def stage_memory(spec: ModelSpec, lay: Layout, m: int) -> list[tuple[float, float]]:
    """``(model state, activations)`` bytes of every pipeline rank, from the layers the split gives it."""
    t, p, v = lay.tp, lay.pp, lay.vpp
    recompute = None if lay.recompute == "none" else lay.recompute
    per_layer = layer_bytes(spec, lay, recompute)
    work = layer_bytes(spec, lay, None) if recompute == "full" else 0.0
    logits = 4 * lay.micro_batch * (spec.seq_length // lay.cp) * spec.padded_vocab(t) / t
    kw = dict(instances=lay.instances, moments=lay.moment_bytes)
    dense_bpp = float(model_state_bytes_per_param(torch.bfloat16, lay.zero, lay.dp * lay.cp, **kw))
    expert_bpp = float(model_state_bytes_per_param(torch.bfloat16, lay.zero, lay.expert_dp, **kw))
    ranges = rank_ranges(spec, lay)
    stages = []
    for i, layers in enumerate(rank_layers(spec, lay)):
        dense, expert = stage_params(spec, t, p, lay.ep, i == 0, i == p - 1, i, lay.etp, ranges[i])
        sizes = tuple(hi - lo for lo, hi in ranges[i])
        if len(set(sizes)) > 1:  # chunks of unequal size: their layers in flight
            acts = held_layers(p, i, m, sizes, lay.schedule) * per_layer + work
        else:
            acts = layers * per_layer * in_flight_microbatches(p, i, m, v, lay.schedule) + work
        if i == p - 1:  # the MTP layers and every depth's logits, one micro-batch in flight
            acts += spec.mtp_num_layers * per_layer + (1 + spec.mtp_num_layers) * logits
        stages.append((dense * dense_bpp + expert * expert_bpp, acts))
    return stages


def comm_seconds(spec: ModelSpec, cluster: ClusterSpec, lay: Layout, m: int) -> dict:
    """Seconds per step one GPU spends sending, per group kind (:mod:`.volumes` over the group's bandwidth)."""
    t, cp, dp = lay.tp, lay.cp, lay.dp
    p, ranges = lay.pp, rank_ranges(spec, lay)
    dense, expert = max((stage_params(spec, t, p, lay.ep, i == 0, i == p - 1, i, lay.etp, ranges[i]) for i in range(p)),
                        key=sum)
    return {
        "tp": volumes.tp_bytes(spec, lay, m) / _bandwidth(cluster, 1, t),
        "cp": volumes.cp_bytes(spec, lay, m) / _bandwidth(cluster, t, cp),
        "ep": volumes.ep_bytes(spec, lay, m) / _bandwidth(cluster, lay.expert_tp, lay.ep),
        "etp": volumes.etp_bytes(spec, lay, m) / _bandwidth(cluster, 1, lay.expert_tp),
        "pp": volumes.pp_bytes(spec, lay, m) / _bandwidth(cluster, t * cp * dp, lay.pp),
        "dp": _dp_seconds(cluster, lay, dense, expert, m),
    }


def _dp_seconds(cluster: ClusterSpec, lay: Layout, dense: float, expert: float, m: int) -> float:
    """Data-parallel traffic over its bandwidth: the strategy's collectives inside an instance (the
    DP x CP group, or one of its ``instances`` blocks of consecutive ranks), plus with hybrid sharding
    one all-reduce a step of the gradient shard across the instances (ranks a block apart)."""
    n, block, expert_block = lay.instances, lay.dp * lay.cp // lay.instances, lay.expert_dp // lay.instances
    inner = volumes.dp_bytes(dense, lay.zero, block, m) + volumes.dp_bytes(expert, lay.zero, expert_block, m)
    seconds = inner / _bandwidth(cluster, lay.tp, block)  # an expert block spans the same ranks
    if n > 1:
        cross = volumes.replica_bytes(dense, block, n) + volumes.replica_bytes(expert, expert_block, n)
        seconds += cross / _bandwidth(cluster, lay.tp * block, n)
    return seconds


@lru_cache(maxsize=256)
def step_flops(spec: ModelSpec, tp: int, global_batch: int, recompute: str) -> tuple[float, float]:
    """``(hardware, model)`` FLOPs of one step: the hardware count includes what ``recompute`` repeats."""
    padded = spec.with_vocab(tp)
    moe = padded if spec.is_moe else None
    hardware = num_floating_point_operations(padded, global_batch, recompute == "full", moe_config=moe)
    if recompute == "selective":
        hardware += sum(core_attention_flops(padded, global_batch, window)
                        for window in layer_windows(padded)[:spec.num_layers])
    return hardware, num_floating_point_operations(padded, global_batch, False, moe_config=moe)


@lru_cache(maxsize=256)
def pipeline_bubble(p: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Idle over busy time of the pipeline (Narayanan's bubble fraction). 1F1B: ``(p-1)/(v m)``.
    ZB-H1, with a micro-batch's forward, input-gradient (B) and weight-gradient (W) passes taking
    equal time (a backward twice a forward): its order simulated (:func:`simulate`), which is
    ``(p-1)/(3m)`` once ``m >= p`` (W fills two thirds of 1F1B's idle time); with fewer
    micro-batches the cooldown has too few W passes to fill it. Interleaved zero bubble (``v > 1``):
    likewise ``(p-1)/(3vm)`` once ``m >= 2p``, its order simulated at ``m = p``."""
    if p == 1:
        return 0.0
    if schedule != "zb-h1":
        return (p - 1) / (v * m)
    if m >= (p if v == 1 else 2 * p):
        return (p - 1) / (3 * v * m)
    return bubble_fraction(simulate({r: rank_order(p, r, m, v, schedule) for r in range(p)}, p, v, 1.0, 1.0, 1.0))


def estimate(spec: ModelSpec, cluster: ClusterSpec, global_batch: int, lay: Layout) -> Estimate:
    """Memory and step time of ``lay`` (checked first by :func:`check_layout`)."""
    check_layout(spec, cluster, global_batch, lay)
    m = global_batch // (lay.dp * lay.micro_batch)
    hardware, model = step_flops(spec, lay.tp, global_batch, lay.recompute)
    peak = cluster.peak_tflops * 1e12
    busiest = busiest_share(spec, lay)
    compute = hardware / cluster.gpus / (peak * MATMUL_EFFICIENCY) * busiest  # the busiest rank paces the pipeline
    comm = comm_seconds(spec, cluster, lay, m)
    bubble = pipeline_bubble(lay.pp, m, lay.vpp, lay.schedule)
    step = (compute + comm["tp"] + comm["cp"] + comm["ep"] + comm["etp"] + comm["pp"]) * (1 + bubble) + comm["dp"]
    states, activations = memory_bytes(spec, lay, m)
    total = states + activations + RESERVED_BYTES
    return Estimate(
        layout=lay, num_microbatches=m, model_state_gb=states / GB, activation_gb=activations / GB,
        memory_gb=total / GB, fits=total <= cluster.gpu_memory_gb * GB, compute_s=compute, comm_s=comm,
        bubble=bubble, busiest=busiest, step_s=step, tflops_per_gpu=hardware / cluster.gpus / step / 1e12,
        mfu=model / cluster.gpus / step / peak, split=split_label(spec, lay),
    )
