"""Rank-aware printing, shared by the checkpoint code and the training loop.

It sits below both (it imports only ``torch.distributed``), so that writing or reading a checkpoint
never imports the training loop: ``checkpoint/`` -> ``console`` <- ``training/``.
"""

from __future__ import annotations

import torch.distributed as dist


def global_rank() -> int:
    """This process's global rank (0 when torch.distributed is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only (every rank when torch.distributed is not initialised)."""
    if global_rank() == 0:
        print(message, flush=True)


def is_logging_rank(state) -> bool:
    """The rank that prints training lines: last pipeline stage, TP rank 0, DP rank 0 (CP rank 0)."""
    return state.is_last_stage() and state.tp_rank == 0 and state.dp_rank == 0 and state.cp_rank == 0
