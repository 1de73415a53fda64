"""Closed-form bytes one GPU sends per training step, per group kind, for a planned layout.

Each transfer is priced by :func:`megatron_lite.perf.comm_volume.ring_bytes` (the ring volumes the
``--log-comm-volume`` counter uses). Activations are 16-bit (:data:`ACT_BYTES`), gradients fp32,
weights gathered in 16 bits. ``lay`` is a :class:`~.estimate.Layout`, ``m`` the micro-batches per
step of one pipeline, s = seq/CP the tokens a rank holds, b the micro-batch, t = TP, c = CP.
Under full recomputation the recomputed forward repeats the forward's traffic. Per-layer traffic is
counted for the busiest pipeline stage (:func:`stage_layer_counts`: the most layers, the MTP
layers counted on the last stage, and the most MoE layers).

* TP: per layer and micro-batch two all-reduces of ``b s h`` forward and two backward (with
  sequence parallelism the same bytes as all-gathers + reduce-scatters), and one more each for the
  word embedding's output (first stage, forward) and the output layer's input (last stage, backward);
  the MTP depths' own embedding, projection and output collectives are not priced. An MoE layer without
  shared experts has only the attention's half: its experts' traffic is the expert-TP term below. Multi-latent attention
  replaces the backward all-reduce at the attention's input by one of what its column-parallel
  projections read, ``b s (rq + rkv + dr)`` (``h`` for ``rq`` without q compression): the q and kv
  latents and the shared rotary key (under SP: all-gathered forward, reduce-scattered backward).
* CP (ring, ``p2p``): the K/V buffer ``2 b (g/t) s d`` travels c-1 hops forward; backward c-1
  hops again plus c hops of its gradient, which the ring accumulates and sends in fp32. MLA's buffer holds every head's expanded key and value,
  ``b (a/t) s (dn + dr + dv)``.
* EP (all-to-all dispatcher, uniform routing): the ``k b s / t`` routed slots of a rank's tokens,
  (e-1)/e of them to other ranks, go out and come back (dispatch, combine), forward and backward.
* Expert TP (ETP = ``--expert-tensor-parallel-size``, default TP): the tokens a rank received are
  all-gathered over its ETP group before the experts and the outputs reduce-scattered after, each
  ``ETP k b s / t`` slots of ``h`` (ring: ``(ETP-1) k b s h / t`` bytes sent), forward and backward.
* PP: per micro-batch and model chunk the activation ``b s h / t`` forward and its gradient back.
* DP: ``no_shard`` all-reduces the fp32 gradients; ``optim`` reduce-scatters them and all-gathers
  the 16-bit weights; ``optim_grads`` reduce-scatters every micro-batch's gradients (nothing holds
  them whole); ``optim_grads_params`` also all-gathers the weights before each forward and backward.
  With hybrid sharding (N instances) these run inside an instance of DP x CP / N ranks, and
  :func:`replica_bytes` adds one all-reduce a step of the fp32 gradient shard across the instances.
"""

from __future__ import annotations

from ...moe.layer_pattern import parse_moe_layer_freq
from ..comm_volume import ring_bytes
from .model import default_ranges
from .split import rank_ranges

ACT_BYTES = 2
GRAD_BYTES = 4  # the ring attention's dK/dV partial sums (fp32 accumulators)


def _passes(lay) -> int:
    """Forward-like passes over the layers per micro-batch: forward (+ recomputed forward) + backward."""
    return 3 if lay.recompute == "full" else 2


def stage_layer_counts(spec, pp: int, ranges: tuple | None = None) -> tuple[int, int]:
    """(layers, MoE layers) of the busiest pipeline stage, each maximised over the stages (``ranges``:
    every rank's chunks, :func:`~.split.rank_ranges`; by default the split naming no flags)."""
    ranges = default_ranges(spec, pp) if ranges is None else ranges
    pattern = parse_moe_layer_freq(spec.moe_layer_freq, spec.num_layers) if spec.is_moe else [False] * spec.num_layers
    mtp = spec.mtp_num_layers
    layers, moe = 0, 0
    for i, chunks in enumerate(ranges):
        kinds = [pattern[j] for lo, hi in chunks for j in range(lo, hi)] + (pattern[-1:] * mtp if i == pp - 1 else [])
        layers, moe = max(layers, len(kinds)), max(moe, sum(kinds))
    return layers, moe


def _busiest(spec, lay) -> tuple[int, int]:
    return stage_layer_counts(spec, lay.pp, rank_ranges(spec, lay))


def _attention_input(spec) -> int:
    """Per token, what the attention's column-parallel projections read (all-reduced in backward)."""
    if not spec.multi_latent_attention:
        return spec.hidden_size
    q = spec.hidden_size if spec.q_lora_rank is None else spec.q_lora_rank
    return q + spec.kv_lora_rank + spec.qk_pos_emb_head_dim


def tp_bytes(spec, lay, m: int) -> float:
    if lay.tp == 1:
        return 0.0
    tokens = lay.micro_batch * (spec.seq_length // lay.cp) * ACT_BYTES
    hidden = ring_bytes("all_reduce", tokens * spec.hidden_size, lay.tp)
    attention_in = ring_bytes("all_reduce", tokens * _attention_input(spec), lay.tp)
    attention, mlp = (_passes(lay) - 1) * hidden + attention_in, _passes(lay) * hidden
    layers, moe = _busiest(spec, lay)
    mlps = layers if spec.moe_shared_expert_intermediate_size else layers - moe  # the experts: etp_bytes
    ends = 2 if lay.pp == 1 else 1  # the embedding's output and the output layer's input (a stage holds one)
    return float((attention * layers + mlp * mlps + ends * hidden) * m)


def cp_bytes(spec, lay, m: int) -> float:
    c = lay.cp
    if c == 1:
        return 0.0
    if spec.multi_latent_attention:
        per_token = (spec.num_attention_heads // lay.tp) * (spec.qk_head_dim + spec.qk_pos_emb_head_dim + spec.v_head_dim)
    else:
        per_token = 2 * max(spec.num_query_groups // lay.tp, 1) * spec.kv_channels
    kv = lay.micro_batch * (spec.seq_length // c) * per_token
    hops = (c - 1) * (_passes(lay) - 1) + (c - 1)  # the 16-bit K/V; then c hops of its fp32 gradient
    per_layer = hops * ring_bytes("send", kv * ACT_BYTES, c) + c * ring_bytes("send", kv * GRAD_BYTES, c)
    return float(per_layer * _busiest(spec, lay)[0] * m)


def ep_bytes(spec, lay, m: int) -> float:
    e = lay.ep
    if e == 1 or not spec.is_moe:
        return 0.0
    moe_layers = _busiest(spec, lay)[1]
    slots = spec.moe_router_topk * lay.micro_batch * spec.seq_length // (lay.cp * lay.tp)
    one_way = ring_bytes("all_to_all", slots * spec.hidden_size * ACT_BYTES, e) * (e - 1) / e
    return float(2 * _passes(lay) * one_way * moe_layers * m)


def etp_bytes(spec, lay, m: int) -> float:
    e = lay.expert_tp
    if e == 1 or not spec.is_moe:
        return 0.0
    slots = spec.moe_router_topk * lay.micro_batch * spec.seq_length // (lay.cp * lay.tp)
    gather = ring_bytes("all_gather", e * slots * spec.hidden_size * ACT_BYTES, e)  # = the reduce-scatter
    return float(2 * _passes(lay) * gather * _busiest(spec, lay)[1] * m)


def pp_bytes(spec, lay, m: int) -> float:
    if lay.pp == 1:
        return 0.0
    n = lay.micro_batch * (spec.seq_length // lay.cp) * spec.hidden_size * ACT_BYTES // lay.tp
    return float(2 * lay.vpp * m * ring_bytes("send", n, 2))


def dp_bytes(params: float, zero: str, shard: int, m: int) -> float:
    """Bytes for ``params`` weights replicated over ``shard`` data-parallel ranks."""
    if shard == 1 or params == 0:
        return 0.0
    grads, weights = int(params) * 4, int(params) * ACT_BYTES
    if zero == "no_shard":
        return float(ring_bytes("all_reduce", grads, shard))
    reduce = ring_bytes("reduce_scatter", grads, shard)
    gather = ring_bytes("all_gather", weights, shard)
    if zero == "optim":
        return float(reduce + gather)
    if zero == "optim_grads":
        return float(m * reduce + gather)
    return float(m * (reduce + 2 * gather))


def replica_bytes(params: float, shard: int, instances: int) -> float:
    """Hybrid sharding: the all-reduce, once a step, of the fp32 gradient shard (``params / shard``
    elements) over the ``instances`` ranks holding the same shard."""
    if instances == 1 or params == 0:
        return 0.0
    return float(ring_bytes("all_reduce", int(params) * 4, instances)) / shard
