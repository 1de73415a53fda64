"""The experts' own rank grid ("parallel folding": --expert-tensor-parallel-size independent of
--tensor-model-parallel-size, as in Megatron-LM).

The ranks of one pipeline stage (TP x CP x DP of the attention part, consecutive because pipeline
parallelism is outermost) are cut a second time, for the MoE layers only, as ETP x EP x EDP with
expert tensor parallelism innermost (Megatron-LM's expert order ``tp-ep-dp-pp``)::

    rank = etp_r + etp * (ep_r + ep * (edp_r + edp * pp_r)),    edp = tp * cp * dp / (etp * ep)

Context parallelism has no expert dimension: its ranks hold different tokens of the same samples,
like data-parallel ranks, so they fold into EP and EDP.

The folded grid is used when the unfolded one cannot describe the experts: when
--expert-model-parallel-size does not divide the data-parallel size, or when
--expert-tensor-parallel-size is neither 1 nor --tensor-model-parallel-size. Otherwise the experts
keep the layout of :mod:`megatron_lite.parallel.state` (EP carved out of DP, ETP = the TP group or
whole experts), which is the same as Megatron-LM's at CP 1 and ETP = TP.
"""

from __future__ import annotations

import numpy as np

# The groups the folded grid replaces, and the axis each one varies in the [pp, edp, ep, etp] grid.
EXPERT_GROUP_AXES = {"expert_dp": 1, "ep": 2, "etp": 3}


def is_folded(tp: int, cp: int, dp: int, ep: int, etp: int | None) -> bool:
    """Whether the experts need their own grid (see the module docstring)."""
    etp = tp if etp is None else etp
    return dp % ep != 0 or etp not in (1, tp)


def expert_dp_size(tp: int, cp: int, dp: int, ep: int, etp: int | None) -> int:
    """The ranks of a stage holding the same expert shard: TP x CP x DP / (ETP x EP) on the folded grid,
    DP x CP / EP otherwise (EP inside DP; whole experts at TP > 1 are also copied on the TP ranks)."""
    if is_folded(tp, cp, dp, ep, etp):
        return tp * cp * dp // ((tp if etp is None else etp) * ep)
    return dp * cp // ep


def folding_problem(tp: int, cp: int, dp: int, ep: int, etp: int) -> str | None:
    """One line naming the flags when ETP x EP does not divide the ranks of a pipeline stage, or None."""
    stage = tp * cp * dp
    if stage % (etp * ep):
        return (f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} = {etp * ep} must divide "
                f"the ranks of one pipeline stage (tensor {tp} x context {cp} x data {dp} = {stage}); "
                "change either expert size")
    return None


def expert_coords(rank: int, stage: int, etp: int, ep: int) -> dict[str, int]:
    """``etp``, ``ep`` and ``edp`` coordinates of ``rank`` in the folded grid (``stage`` ranks per stage)."""
    local = rank % stage
    return {"etp": local % etp, "ep": local // etp % ep, "edp": local // (etp * ep)}


def expert_groups(name: str, world: int, pp: int, etp: int, ep: int) -> list[list[int]]:
    """Every rank list of the folded group ``name`` (``ep``, ``etp`` or ``expert_dp``)."""
    edp = world // (pp * etp * ep)
    grid = np.arange(world).reshape(pp, edp, ep, etp)
    rows = np.moveaxis(grid, EXPERT_GROUP_AXES[name], -1)
    return [sorted(row) for row in rows.reshape(-1, rows.shape[-1]).tolist()]


def expert_amax_groups(world: int, pp: int, tp: int, cp: int, etp: int, ep: int) -> list[list[int]]:
    """Every rank list of the folded grid's ``expert_amax`` group: the ranks whose copies of the same
    experts (same EP rank, every ETP shard) take their tokens from the same micro-batches, i.e. from
    the same data-parallel ranks of the dense grid (``local // (tp x cp)`` in a stage). Their tokens
    together are what those experts see in a run without context parallelism, so an FP8 expert's
    current-scaling amax is MAX-reduced over them; replicas fed other micro-batches stay apart."""
    stage, block = world // pp, etp * ep
    groups: dict[tuple, list[int]] = {}
    for rank in range(world):
        local = rank % stage
        first = local // block * block  # the EP x ETP block this rank's tokens come from
        sources = frozenset(r // (tp * cp) for r in range(first, first + block))
        key = (rank // stage, expert_coords(rank, stage, etp, ep)["ep"], sources)
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())
