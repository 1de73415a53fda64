"""Context- and expert-parallel traffic is counted, exactly, under its own group kind.

One forward and backward of the CP core attention or of an MoE token dispatcher runs inside a
:class:`CommVolume`; every rank's counts ``{(kind, op): bytes}`` must equal the closed forms below
(fp32, 4 bytes per element; n bytes over g ranks: all-gather / reduce-scatter (g-1)/g n, a send n,
an all-to-all the rows that leave the rank), and nothing else may be counted.

Context parallelism, c ranks, each holding s = S/c tokens of b sequences, nq query heads and nkv
key/value heads of d channels (kind ``cp``):
- p2p (ring): one K/V buffer KV = 2·b·nkv·s·d·4 bytes travels c-1 hops forward, c-1 hops again in
  backward, and the dK/dV buffer (same size, fp32) c hops: (3c-2)·KV sent.
- a2a (Ulysses): q, k, v and the output each cross one all-to-all forward and one backward, each
  sending (c-1)/c of its s·b·n·d·4 bytes: 4·(c-1)/c·s·b·d·4·(nq+nkv).
- allgather: the stacked K/V [s, 2, b, nkv, d] is all-gathered ((c-1)·KV) and its gradient
  reduce-scattered ((c-1)·KV).
- a2a+p2p, c = A x B: the a2a volume over A ranks, 4·(A-1)/A·s·b·d·4·(nq+nkv), plus the ring's over
  B ranks on A·s tokens of nkv/A heads, whose K/V buffer is again KV: (3B-2)·KV sent.

Expert parallelism, e ranks, T tokens of hidden h per rank, E experts, top-k (kind ``ep``):
- all-to-all dispatcher: the per-expert token counts (E int64) are all-gathered, (e-1)·E·8; with
  R_out = routed slots of this rank whose expert lives elsewhere and R_in = slots other ranks route
  to this rank's experts (read from every rank's routing, which each rank can regenerate): the rows
  go out (R_out·h·4) with their weights (R_out·4), come back in combine (R_in·h·4), and backward
  reverses all three: all-to-all total (2·R_out + 2·R_in)·h·4 + (R_out + R_in)·4.
- all-gather dispatcher: tokens [T, h], weights [T, E] and the uint8 routing map [T, E] are
  all-gathered, the outputs reduce-scattered; backward reduce-scatters the token and weight
  gradients and all-gathers the output gradient: all-gather (e-1)·T·(2·h·4 + E·4 + E),
  reduce-scatter (e-1)·T·(2·h·4 + E·4). Independent of the routing: every token goes everywhere.
"""

from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from megatron_lite.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from megatron_lite.parallel.context import ContextParallelAttention
from megatron_lite.perf.comm_volume import CommVolume
from tests.distributed.test_moe_dispatcher import EXPERTS, HIDDEN, TOKENS, _routing, _tagged_identity
from tests.harness import cached_state, run_ranks
from tests.moe_helpers import moe_config

B, D = 2, 8


def count_cp(cp, comm_type, nq, nkv, seq, hcp=None):
    state = cached_state(cp=cp) if hcp is None else cached_state(cp=cp, hcp=hcp)
    config = SimpleNamespace(cp_comm_type=comm_type, attention_dropout=0.0, num_attention_heads=nq,
                             num_query_groups=nkv)
    attn = ContextParallelAttention(config, state, layer_number=1)
    gen = torch.Generator().manual_seed(state.rank)
    s = seq // cp
    q, k, v = (torch.randn(s, B, n, D, generator=gen).requires_grad_() for n in (nq, nkv, nkv))
    volume = CommVolume()
    with volume.counting():
        attn(q, k, v, None, True).backward(torch.randn(s, B, nq * D, generator=gen))
    return volume.end_step()


def _cp_closed_form(c, comm_type, nq, nkv, seq, hcp=None):
    s = seq // c
    kv = 2 * B * nkv * s * D * 4
    if comm_type == "a2a+p2p":
        a, b = hcp
        return {("cp", "all_to_all"): Fraction(4 * (a - 1) * s * B * D * 4 * (nq + nkv), a),
                ("cp", "send"): Fraction((3 * b - 2) * kv)}
    if comm_type == "p2p":
        return {("cp", "send"): Fraction((3 * c - 2) * kv)}
    if comm_type == "a2a":
        return {("cp", "all_to_all"): Fraction(4 * (c - 1) * s * B * D * 4 * (nq + nkv), c)}
    return {("cp", "all_gather"): Fraction((c - 1) * kv), ("cp", "reduce_scatter"): Fraction((c - 1) * kv)}


@pytest.mark.parametrize("cp,comm_type,nq,nkv,hcp", [
    (2, "p2p", 4, 2, None), (4, "p2p", 4, 4, None), (2, "a2a", 4, 2, None), (4, "a2a", 8, 4, None),
    (2, "allgather", 4, 2, None), (4, "a2a+p2p", 8, 4, (2, 2)),
])
def test_cp_attention_bytes_equal_closed_forms(cp, comm_type, nq, nkv, hcp):
    seq = 8 * cp
    want = _cp_closed_form(cp, comm_type, nq, nkv, seq, hcp)
    for rank, counts in enumerate(run_ranks(cp, count_cp, cp, comm_type, nq, nkv, seq, hcp)):
        assert counts == want, f"rank {rank}: counted {counts}, closed form {want}"


def count_ep(kind, ep):
    state = cached_state(ep=ep)
    config = moe_config(num_experts=EXPERTS, moe_token_dispatcher_type=kind, expert_model_parallel_size=ep)
    dispatcher = (AllToAllDispatcher if kind == "alltoall" else AllGatherDispatcher)(config, state)
    gen = torch.Generator().manual_seed(50 + state.rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).requires_grad_()
    probs, rmap = _routing(7 + state.rank, None, False)
    probs = probs.clone().requires_grad_()
    volume = CommVolume()
    with volume.counting():
        dispatcher.run(x, probs, rmap, _tagged_identity(dispatcher, 1)).backward(torch.randn(TOKENS, HIDDEN))
    return volume.end_step()


def _ep_closed_form(kind, ep, rank):
    e, t, h, n = ep, TOKENS, HIDDEN, EXPERTS
    if kind == "allgather":
        return {("ep", "all_gather"): Fraction((e - 1) * t * (2 * h * 4 + n * 4 + n)),
                ("ep", "reduce_scatter"): Fraction((e - 1) * t * (2 * h * 4 + n * 4))}
    local = n // e
    counts = [_routing(7 + r, None, False)[1].sum(dim=0) for r in range(e)]  # every rank's routed slots per expert
    mine = slice(rank * local, (rank + 1) * local)
    r_out = int(counts[rank].sum()) - int(counts[rank][mine].sum())
    r_in = sum(int(counts[j][mine].sum()) for j in range(e) if j != rank)
    return {("ep", "all_gather"): Fraction((e - 1) * n * 8),
            ("ep", "all_to_all"): Fraction((2 * r_out + 2 * r_in) * h * 4 + (r_out + r_in) * 4)}


@pytest.mark.parametrize("kind,ep", [("alltoall", 2), ("alltoall", 4), ("allgather", 2), ("allgather", 4)])
def test_moe_dispatch_bytes_equal_closed_forms(kind, ep):
    for rank, counts in enumerate(run_ranks(ep, count_ep, kind, ep)):
        want = _ep_closed_form(kind, ep, rank)
        assert counts == want, f"rank {rank}: counted {counts}, closed form {want}"
