"""The rank grid and every process group, built once from the parallel sizes.

Ranks are laid out in Megatron's order ``tp-cp-ep-dp-pp`` with tensor parallelism innermost::

    rank = tp_r + tp * (cp_r + cp * (ep_r + ep * (edp_r + edp * pp_r)))

Expert parallelism is carved out of the data-parallel dimension: the full data-parallel rank is
``dp_r = ep_r + ep * edp_r`` (``edp = dp / ep``), so dense weights are replicated over all ``dp``
ranks while expert weights are sharded over ``ep`` and replicated over ``edp`` (and ``cp``).

:class:`RankGrid` (``rank_grid.py``) is pure Python (no processes) and answers "which ranks form each group";
:class:`ParallelState` turns those lists into ``torch.distributed`` groups. A group of one rank is
represented by ``None`` and every collective in :mod:`megatron_lite.parallel.comm` skips it, so a
single process needs no ``torch.distributed`` at all.

Hybrid sharding (``--num-distributed-optimizer-instances N``) splits each DP x CP group into N
consecutive blocks of ``dp x cp / N`` ranks: ``dp_shard`` (one block: the distributed optimizer
shards over it) and ``dp_replicate`` (the ranks at the same position of every block: they hold the
same shard). N must divide dp x cp (as in Megatron-LM); a block holds whole CP groups when N divides
dp, and otherwise splits them (CP4 x DP1 in 2 instances: blocks of 2 CP ranks).
Expert parameters shard over their own group, so its expert-DP x CP group is cut the same way
(``expert_dp_shard``, ``expert_dp_replicate``); N must divide its size (edp x cp) too. When N divides
edp, the expert block of a rank lies inside its dense block: an instance is one set of ranks.

Hierarchical CP (``hcp=(A, B)``, --hierarchical-context-parallel-sizes) cuts each CP group further
into ``cp_a2a`` groups of A consecutive CP ranks and ``cp_ring`` groups of the B ranks at one
position of every ``cp_a2a`` group (Megatron-LM's first level is the consecutive one).

Expert tensor parallelism (``etp``, --expert-tensor-parallel-size) is the TP group or none (whole
experts) in this layout. Other sizes, or an EP that does not divide DP, re-cut each pipeline stage
for the experts (:mod:`megatron_lite.parallel.expert_grid`, ``RankGrid.folded``): the ``ep``, ``etp``
and ``expert_dp`` groups then come from that grid and the dense dimensions ignore EP. ``expert_amax``
(the FP8 experts' amax group: copies of the same experts fed tokens of the same micro-batches) is
``tp_cp`` unfolded and :func:`~megatron_lite.parallel.expert_grid.expert_amax_groups` folded.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from ..device import call_at_shutdown, process_group_timeout
from .random import RNGStatesTracker
from .rank_grid import GROUP_DIMS, HYBRID_GROUPS, ParallelConfigError, RankGrid

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_GROUPS_WORLD: list = [None]  # the default group the cached groups belong to


def _group_of(ranks: list[int]) -> dist.ProcessGroup:
    """The process group of ``ranks``, created once per process (collective on first use) and reused
    by every later ParallelState: a process that trains many runs (a test pool, a notebook) would
    otherwise keep the threads of hundreds of identical gloo groups, each waking up while idle."""
    if _GROUPS_WORLD[0] is not dist.group.WORLD:  # a new default group: the old groups are gone
        _GROUPS.clear()
        _GROUPS_WORLD[0] = dist.group.WORLD
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks, timeout=process_group_timeout())  # --distributed-timeout-minutes
    return _GROUPS[key]


def forget_groups() -> None:
    """Drop the cached groups (their default group is being destroyed): with no reference left,
    collecting them joins their communication threads (called by device.shutdown_distributed)."""
    _GROUPS.clear()
    _GROUPS_WORLD[0] = None


call_at_shutdown(forget_groups)


class ParallelState:
    """Process groups and rank helpers for one rank of a :class:`RankGrid`.

    Build it once after ``torch.distributed`` is initialised (or without it for a single process)
    and hand it to the layers that communicate. Every rank must build the same states in the same
    order, because group creation is collective. It also owns this rank's model-parallel RNG
    tracker (``rng_tracker``, seeded by :func:`megatron_lite.parallel.random.model_parallel_seed`).
    """

    def __init__(self, tp=1, pp=1, cp=1, ep=1, dp=None, vpp=None, world_size=None, rank=None, dist_opt_instances=1,
                 hcp=None, etp=None):
        distributed = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        self.grid = RankGrid(world_size, tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, vpp=vpp,
                             dist_opt_instances=dist_opt_instances, etp=etp)
        self.rank = rank
        self.world_size = world_size
        self.rng_tracker = RNGStatesTracker()
        if world_size > 1 and not distributed:
            raise RuntimeError("a ParallelState over several ranks needs torch.distributed initialised first")
        self._ranks: dict[str, list[int]] = {}
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        names = list(GROUP_DIMS) + ["etp", "expert_amax", "embedding"] + list(HYBRID_GROUPS)
        for name in names:
            if name.endswith("_shard") and dist_opt_instances == 1:
                self._ranks[name] = self._ranks[HYBRID_GROUPS[name]]
                continue  # the (expert-)DP x CP group itself (aliased below)
            all_lists = self.grid.embedding_groups() if name == "embedding" else self.grid.groups(name)
            # middle pipeline stages are in no embedding group: a group of one
            self._ranks[name] = next((r for r in all_lists if rank in r), [rank])
            self._groups[name] = None
            if name != "embedding" and all(len(ranks) == 1 for ranks in all_lists):
                continue  # groups of one: no communicator needed (sizes may differ: expert_amax folded)
            for ranks in all_lists:  # collective: every rank creates every group, in order
                if len(ranks) == 1:
                    continue
                group = _group_of(ranks)
                if rank in ranks:
                    self._groups[name] = group
        if self.grid.cp == 1:  # the same ranks: one group object, so "reduce over DP x CP" is the DP group
            self._groups["dp_cp"] = self._groups["dp"]
        if dist_opt_instances == 1:  # no hybrid sharding: shard over the whole DP x CP group
            self._groups["dp_shard"] = self._groups["dp_cp"]
            self._groups["expert_dp_shard"] = self._groups["expert_dp"]
        self.hcp_sizes = tuple(hcp) if hcp else None  # (all-to-all size, ring size) for cp_comm_type a2a+p2p
        if self.hcp_sizes:
            if len(self.hcp_sizes) != 2 or math.prod(self.hcp_sizes) != cp:
                raise ParallelConfigError(f"--hierarchical-context-parallel-sizes {hcp} must be two sizes whose "
                                          f"product is --context-parallel-size {cp}")
            self._build_hierarchical_cp(self.hcp_sizes[0])
        coords = self.grid.coords(rank)
        self.tp_rank, self.cp_rank, self.pp_rank = coords["tp"], coords["cp"], coords["pp"]
        self.ep_rank, self.expert_dp_rank, self.etp_rank = coords["ep"], coords["edp"], coords["etp"]
        self.dp_rank = coords["dp"]

    def _build_hierarchical_cp(self, inner: int) -> None:
        """The ``cp_a2a`` and ``cp_ring`` groups (collective: every rank creates all of them, in order)."""
        for name, all_lists in zip(("cp_a2a", "cp_ring"), self.grid.hierarchical_cp_groups(inner)):
            self._ranks[name] = next(r for r in all_lists if self.rank in r)
            self._groups[name] = None
            for ranks in all_lists:
                if len(ranks) > 1:
                    group = _group_of(ranks)
                    if self.rank in ranks:
                        self._groups[name] = group

    # sizes ---------------------------------------------------------------------------------
    tp_size = property(lambda self: self.grid.tp)
    pp_size = property(lambda self: self.grid.pp)
    cp_size = property(lambda self: self.grid.cp)
    ep_size = property(lambda self: self.grid.ep)
    dp_size = property(lambda self: self.grid.dp)
    vpp_size = property(lambda self: self.grid.vpp)
    expert_dp_size = property(lambda self: self.grid.edp)
    etp_size = property(lambda self: self.grid.expert_tp)
    folded = property(lambda self: self.grid.folded)  # the experts have their own grid

    # groups (None = a group of one rank) ---------------------------------------------------
    def group(self, name: str):
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        return self._ranks[name]

    tp_group = property(lambda self: self._groups["tp"])
    pp_group = property(lambda self: self._groups["pp"])
    dp_group = property(lambda self: self._groups["dp"])
    cp_group = property(lambda self: self._groups["cp"])
    dp_cp_group = property(lambda self: self._groups["dp_cp"])
    mp_group = property(lambda self: self._groups["mp"])
    ep_group = property(lambda self: self._groups["ep"])
    expert_dp_group = property(lambda self: self._groups["expert_dp"])
    etp_group = property(lambda self: self._groups["etp"])
    embedding_group = property(lambda self: self._groups["embedding"])
    dp_shard_group = property(lambda self: self._groups["dp_shard"])  # distributed-optimizer shards
    dp_replicate_group = property(lambda self: self._groups["dp_replicate"])  # same shard, other instances
    expert_dp_shard_group = property(lambda self: self._groups["expert_dp_shard"])  # expert optimizer shards
    expert_dp_replicate_group = property(lambda self: self._groups["expert_dp_replicate"])
    dist_opt_instances = property(lambda self: self.grid.dist_opt_instances)

    # pipeline helpers ----------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def in_embedding_group(self) -> bool:
        return self.rank in self._ranks["embedding"] and len(self._ranks["embedding"]) > 1

    @property
    def next_pp_rank(self) -> int:
        ranks = self._ranks["pp"]
        return ranks[(self.pp_rank + 1) % len(ranks)]

    @property
    def prev_pp_rank(self) -> int:
        ranks = self._ranks["pp"]
        return ranks[(self.pp_rank - 1) % len(ranks)]

    def describe(self) -> str:
        g = self.grid
        return (
            f"world {g.world_size} = tp {g.tp} x cp {g.cp} x dp {g.dp}"
            + ("" if g.folded else f" (ep {g.ep} x edp {g.edp})") + f" x pp {g.pp}"
            + (f", vpp {g.vpp}" if g.vpp else "")
            + (f", cp as a2a {self.hcp_sizes[0]} x ring {self.hcp_sizes[1]}" if self.hcp_sizes else "")
            + (f", experts folded: etp {g.expert_tp} x ep {g.ep} x edp {g.edp} per stage" if g.folded else "")
            + (f", data-parallel state sharded over {g.dp * g.cp // g.dist_opt_instances} ranks x {g.dist_opt_instances} "
               "instances" if g.dist_opt_instances > 1 else "")
        )
