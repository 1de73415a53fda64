"""Stopping on a NaN/inf loss or gradient norm (``--check-for-nan-in-loss-and-grad``)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config import Config
from ..device import get_device
from ..parallel.state import ParallelState


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf (``--check-for-nan-in-loss-and-grad``); the message
    names the iteration and rank. Raised before that iteration is saved, by every rank together."""

    on_every_rank = True  # see megatron_lite.errors


def check_finite(config: Config, state: ParallelState, iteration: int, loss: float | None, grad_norm) -> None:
    """Raise :class:`NonFiniteError` when this step's gradient norm (global: every rank sees the same)
    or, without pipeline stages, its loss (DP-averaged: every rank sees the same) is not finite; every
    rank raises together. With --fp16 the loss scaler skips a step whose gradients overflow (its norm
    is None), but a NaN/inf loss comes from the forward pass, which no loss scale cures: it stops the
    run in fp16 too (as in Megatron-LM, whose loss check does not depend on the precision). With
    pipeline stages only the last one holds the loss: a finite gradient norm shows a sound step, and a
    skipped step (fp16) asks the pipeline group whether the last stage's loss was finite."""
    if not config.training.check_for_nan_in_loss_and_grad:
        return
    bad = []
    if state.pp_size == 1:
        if loss is not None and not math.isfinite(loss):
            bad.append(f"loss {loss}")
    elif grad_norm is None and _loss_not_finite_on_some_stage(loss, state):
        bad.append(f"loss {loss}" if loss is not None else "loss not finite on the last pipeline stage")
    if grad_norm is not None and not math.isfinite(grad_norm):
        bad.append(f"gradient norm {grad_norm}")
    if bad:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise NonFiniteError(f"iteration {iteration}, rank {rank}: {' and '.join(bad)}; stopping without saving "
                             "this iteration (--no-check-for-nan-in-loss-and-grad trains on)")


def _loss_not_finite_on_some_stage(loss: float | None, state: ParallelState) -> bool:
    """Whether any stage of this rank's pipeline holds a loss that is not finite (collective over it)."""
    flag = torch.tensor([0.0 if loss is None or math.isfinite(loss) else 1.0], device=get_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.pp_group)
    return bool(flag.item())
