"""The rank grid's arithmetic, with no processes: sizes, each rank's coordinates and the rank lists
of every named group, for the layout described in :mod:`megatron_lite.parallel.state` (which turns
these lists into ``torch.distributed`` groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import expert_grid
from .expert_grid import EXPERT_GROUP_AXES, expert_coords, expert_groups, folding_problem, is_folded

# Outermost first; the rank is the mixed-radix number of its coordinates in this order.
_DIMS = ("pp", "edp", "ep", "cp", "tp")

# Each named group varies these dimensions (and fixes all the others).
GROUP_DIMS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("edp", "ep"),
    "dp_cp": ("edp", "ep", "cp"),
    "mp": ("pp", "tp"),
    "tp_cp": ("cp", "tp"),
    "ep": ("ep",),
    "expert_dp": ("edp", "cp"),
}

# The hybrid-sharding groups (--num-distributed-optimizer-instances) and the group each one cuts.
HYBRID_GROUPS = {"dp_shard": "dp_cp", "dp_replicate": "dp_cp",
                 "expert_dp_shard": "expert_dp", "expert_dp_replicate": "expert_dp"}


class ParallelConfigError(ValueError):
    """Parallel sizes that cannot describe the world."""


@dataclass(frozen=True)
class RankGrid:
    """The pure arithmetic of the rank grid: sizes, coordinates and the rank lists of every group."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int | None = None
    vpp: int | None = None
    dist_opt_instances: int = 1
    etp: int | None = None  # None: the TP size

    def __post_init__(self):
        for name in ("world_size", "tp", "pp", "cp", "ep") + (("etp",) if self.etp is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"{_flag(name)} must be a positive integer, got {value!r}")
        model = self.tp * self.pp * self.cp
        if self.dp is None:
            if self.world_size % model:
                raise ParallelConfigError(
                    f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {self.tp} "
                    f"x --pipeline-model-parallel-size {self.pp} x --context-parallel-size {self.cp} = {model}; "
                    "launch a multiple of that many processes or change the sizes"
                )
            object.__setattr__(self, "dp", self.world_size // model)
        elif self.dp * model != self.world_size:
            raise ParallelConfigError(
                f"--tensor-model-parallel-size {self.tp} x --pipeline-model-parallel-size {self.pp} x "
                f"--context-parallel-size {self.cp} x data-parallel-size {self.dp} = {self.dp * model} "
                f"does not equal the world size {self.world_size}"
            )
        if self.folded:
            problem = folding_problem(self.tp, self.cp, self.dp, self.ep, self.expert_tp)
            if problem:
                raise ParallelConfigError(problem)
        if not isinstance(self.dist_opt_instances, int) or self.dist_opt_instances < 1 \
                or self.dp * self.cp % self.dist_opt_instances:
            raise ParallelConfigError(
                f"--num-distributed-optimizer-instances {self.dist_opt_instances} must be a positive divisor of the "
                f"data-parallel size {self.dp} x context-parallel size {self.cp} = {self.dp * self.cp} (the ranks the "
                "optimizer shards over); change the instances"
            )
        if self.expert_dp_cp % self.dist_opt_instances:
            made = (f"tensor {self.tp} x context {self.cp} x data {self.dp} / "
                    f"(--expert-tensor-parallel-size {self.expert_tp} x " if self.folded else f"data-parallel {self.dp} x context-parallel {self.cp} / (")
            raise ParallelConfigError(
                f"--num-distributed-optimizer-instances {self.dist_opt_instances} must divide the expert data-parallel "
                f"size {self.expert_dp_cp} ({made}--expert-model-parallel-size {self.ep})); lower the instances or "
                "--expert-model-parallel-size"
            )
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise ParallelConfigError(
                "virtual pipeline stages need --pipeline-model-parallel-size > 1; "
                "drop --num-layers-per-virtual-pipeline-stage or raise the pipeline size"
            )

    @property
    def folded(self) -> bool:
        """Whether the experts have their own grid (:mod:`megatron_lite.parallel.expert_grid`)."""
        return is_folded(self.tp, self.cp, self.dp, self.ep, self.etp)

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size (--expert-tensor-parallel-size, default TP)."""
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        if self.folded:
            return self.world_size // (self.pp * self.expert_tp * self.ep)
        return self.dp // self.ep

    @property
    def expert_dp_cp(self) -> int:
        """Ranks holding the same expert shard: expert-DP x CP (folded: expert-DP, which holds CP)."""
        return self.edp if self.folded else self.edp * self.cp

    def sizes(self) -> dict[str, int]:
        """The sizes of the dense grid's dimensions (folded: EP 1, the whole DP in ``edp``)."""
        if self.folded:
            return {"pp": self.pp, "edp": self.dp, "ep": 1, "cp": self.cp, "tp": self.tp}
        return {"pp": self.pp, "edp": self.edp, "ep": self.ep, "cp": self.cp, "tp": self.tp}

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along each dimension, plus ``dp`` and ``etp`` (the experts')."""
        out, rest = {}, rank
        for dim in reversed(_DIMS):
            size = self.sizes()[dim]
            out[dim] = rest % size
            rest //= size
        out["dp"] = out["ep"] + self.sizes()["ep"] * out["edp"]
        if self.folded:
            out.update(expert_coords(rank, self.world_size // self.pp, self.expert_tp, self.ep))
        else:
            out["etp"] = out["tp"] if self.expert_tp == self.tp else 0
        return out

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for dim in _DIMS:
            rank = rank * self.sizes()[dim] + coords.get(dim, 0)
        return rank

    def groups(self, name: str) -> list[list[int]]:
        """All rank lists of group ``name`` (every rank appears in exactly one), each sorted."""
        if name in HYBRID_GROUPS:
            return self._hybrid_groups(name)
        if self.folded and name in EXPERT_GROUP_AXES:
            return expert_groups(name, self.world_size, self.pp, self.expert_tp, self.ep)
        if name == "expert_amax":  # unfolded: the experts' tokens are split like the dense layers'
            return expert_grid.expert_amax_groups(self.world_size, self.pp, self.tp, self.cp, self.expert_tp, self.ep) \
                if self.folded else self.groups("tp_cp")
        if name == "etp":  # unfolded: the TP group, or whole experts on every rank
            return self.groups("tp") if self.expert_tp == self.tp else [[r] for r in range(self.world_size)]
        varying = GROUP_DIMS[name]
        fixed = [d for d in _DIMS if d not in varying]
        grid = np.arange(self.world_size).reshape([self.sizes()[d] for d in _DIMS])
        order = [_DIMS.index(d) for d in fixed] + [_DIMS.index(d) for d in _DIMS if d in varying]
        rows = grid.transpose(order).reshape(-1, math.prod(self.sizes()[d] for d in varying))
        return [sorted(row) for row in rows.tolist()]

    def _hybrid_groups(self, name: str) -> list[list[int]]:
        """Each DP x CP (expert-DP x CP) group cut into ``dist_opt_instances`` consecutive blocks
        (``dp_shard``, ``expert_dp_shard``), or the ranks at one position of every block (``*_replicate``)."""
        n = self.dist_opt_instances
        out = []
        for ranks in self.groups(HYBRID_GROUPS[name]):
            blocks = [ranks[i : i + len(ranks) // n] for i in range(0, len(ranks), len(ranks) // n)]
            out += blocks if name.endswith("_shard") else [list(column) for column in zip(*blocks)]
        return out

    def hierarchical_cp_groups(self, inner: int) -> tuple[list[list[int]], list[list[int]]]:
        """--hierarchical-context-parallel-sizes ``inner outer``: every CP group cut into its all-to-all
        groups (``inner`` consecutive CP ranks, Megatron-LM's first level) and its ring groups (the CP
        ranks at one position of every all-to-all group, ``outer`` of them)."""
        if inner < 1 or self.cp % inner:
            raise ParallelConfigError(f"--hierarchical-context-parallel-sizes: all-to-all size {inner} does not "
                                      f"divide --context-parallel-size {self.cp}")
        a2a, ring = [], []
        for ranks in self.groups("cp"):
            a2a += [ranks[i : i + inner] for i in range(0, self.cp, inner)]
            ring += [ranks[i :: inner] for i in range(inner)]
        return a2a, ring

    def group_of(self, name: str, rank: int) -> list[int]:
        for ranks in self.groups(name):
            if rank in ranks:
                return ranks
        raise AssertionError("unreachable: every rank is in one group")

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline group (they share the tied embedding)."""
        return [sorted({ranks[0], ranks[-1]}) for ranks in self.groups("pp")]


def _flag(name: str) -> str:
    return {
        "tp": "--tensor-model-parallel-size",
        "pp": "--pipeline-model-parallel-size",
        "cp": "--context-parallel-size",
        "ep": "--expert-model-parallel-size",
        "etp": "--expert-tensor-parallel-size",
        "world_size": "world size",
    }[name]
