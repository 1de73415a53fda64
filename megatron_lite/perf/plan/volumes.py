"""Closed-form bytes one GPU sends per training step, per group kind, for a planned layout.

Each transfer is priced by :func:`megatron_lite.perf.comm_volume.ring_bytes` (the ring volumes the
``--log-comm-volume`` counter uses). Activations are 16-bit (:data:`ACT_BYTES`), gradients fp32,
weights gathered in 16 bits. ``lay`` is a :class:`~.estimate.Layout`, ``m`` the micro-batches per
step of one pipeline, s = seq/CP the tokens a rank holds, b the micro-batch, t = TP, c = CP.
Under full recomputation the recomputed forward repeats the forward's traffic.

* TP: per layer and micro-batch two all-reduces of ``b s h`` forward and two backward (with
  sequence parallelism the same bytes as all-gathers + reduce-scatters).
* CP (ring, ``p2p``): the K/V buffer ``2 b (g/t) s d`` travels c-1 hops forward; backward c-1
  hops again plus c hops of its gradient.
* EP (all-to-all dispatcher, uniform routing): the ``k b s / t`` routed slots of a rank's tokens,
  (e-1)/e of them to other ranks, go out and come back (dispatch, combine), forward and backward.
* PP: per micro-batch and model chunk the activation ``b s h / t`` forward and its gradient back.
* DP: ``no_shard`` all-reduces the fp32 gradients; ``optim`` reduce-scatters them and all-gathers
  the 16-bit weights; ``optim_grads`` reduce-scatters every micro-batch's gradients (nothing holds
  them whole); ``optim_grads_params`` also all-gathers the weights before each forward and backward.
"""

from __future__ import annotations

from ...moe.config import parse_moe_layer_freq
from ..comm_volume import ring_bytes

ACT_BYTES = 2


def _passes(lay) -> int:
    """Forward-like passes over the layers per micro-batch: forward (+ recomputed forward) + backward."""
    return 3 if lay.recompute == "full" else 2


def tp_bytes(spec, lay, m: int) -> float:
    if lay.tp == 1:
        return 0.0
    n = lay.micro_batch * (spec.seq_length // lay.cp) * spec.hidden_size * ACT_BYTES
    per_layer = 2 * _passes(lay) * ring_bytes("all_reduce", n, lay.tp)
    return float(per_layer * spec.num_layers // lay.pp * m)


def cp_bytes(spec, lay, m: int) -> float:
    c = lay.cp
    if c == 1:
        return 0.0
    kv_heads = max(spec.num_query_groups // lay.tp, 1)
    kv = 2 * lay.micro_batch * kv_heads * (spec.seq_length // c) * spec.kv_channels * ACT_BYTES
    hops = (c - 1) * (_passes(lay) - 1) + (c - 1) + c
    return float(hops * ring_bytes("send", kv, c) * spec.num_layers // lay.pp * m)


def ep_bytes(spec, lay, m: int) -> float:
    e = lay.ep
    if e == 1 or not spec.is_moe:
        return 0.0
    moe_layers = sum(parse_moe_layer_freq(spec.moe_layer_freq, spec.num_layers)) / lay.pp
    slots = spec.moe_router_topk * lay.micro_batch * spec.seq_length // (lay.cp * lay.tp)
    one_way = ring_bytes("all_to_all", slots * spec.hidden_size * ACT_BYTES, e) * (e - 1) / e
    return float(2 * _passes(lay) * one_way * moe_layers * m)


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
