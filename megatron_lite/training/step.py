"""One training step and one evaluation, as the training loop (``loop.py``) runs them.

``pipe_comm(config, state)`` builds the run's stage-to-stage communicator; ``train_step`` runs every
micro-batch of a global batch through the pipeline schedule, finalises the gradients and takes one
optimizer and scheduler step; ``evaluate`` runs forward-only passes and returns the mean reported losses.
"""

from __future__ import annotations

from functools import partial

import torch

from ..config import Config
from ..device import empty_unused_memory, get_device
from ..moe.metrics import finish_moe_step, set_aux_loss_backward_scale
from ..parallel.data_parallel import finalize_model_grads
from ..parallel.pipeline import PipeComm, get_forward_backward_func
from ..parallel.state import ParallelState
from ..precision.fp8 import update_fp8_scales
from .batch_rampup import num_microbatches
from .per_token_loss import aux_loss_scale, evaluation_losses, reduce_reported, scale_grads_by_tokens
from .timers import Timers


def pipe_comm(config: Config, state: ParallelState) -> PipeComm:
    """The run's stage-to-stage communicator: hidden states ``[s(/tp), b, h]`` in the model's dtype (fp32
    with --fp32-residual-connection: the residual stream crosses stages as it is),
    ``s`` being the tokens of a sample held by one rank (the sequence split over context parallelism).

    Built once per run; every schedule call (training and evaluation) takes it.
    """
    local_seq_length = config.model.seq_length // config.parallel.context_parallel_size
    return PipeComm.for_activations(
        state, seq_length=local_seq_length, micro_batch_size=config.training.micro_batch_size,
        hidden_size=config.model.hidden_size, dtype=config.precision.residual_dtype,
        sequence_parallel=config.parallel.sequence_parallel,
    )


def _forward_backward_and_grads(config, comm, chunks, optimizer, forward_step_func, data_iterator, timers, m,
                                trace=None):
    """Every micro-batch's forward and backward, then the gradients finalised; the reported losses.
    ``trace`` (a list, or a :class:`~megatron_lite.parallel.pipeline.trace.Trace` timing each op) gets the
    schedule's forward/backward ops (the straggler detector's compute time)."""
    state = comm.state
    optimizer.zero_grad()  # also zeroes every chunk's gradient buffer
    # auxiliary losses (routers', a spec module's) get the main loss's backward factor: loss scale / micro-batches (x CP)
    set_aux_loss_backward_scale(chunks, aux_loss_scale(config, state, optimizer.get_loss_scale(), m))
    forward_backward = get_forward_backward_func(state, config.parallel.pipeline_schedule)
    with timers.phase("forward-backward"):
        reported = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=chunks,
            num_microbatches=m,
            comm=comm,
            forward_only=False,
            grad_scale_func=optimizer.scale_loss,
            no_sync_func=[chunk.no_sync for chunk in chunks],  # per chunk: each syncs on its last backward
            trace=trace,
        )
    empty_unused_memory(config.training.empty_unused_memory_level, 1)
    with timers.phase("all-grads-sync"):
        finalize_model_grads(chunks, state)
    return reported


def train_step(config, comm, chunks, optimizer, scheduler, forward_step_func, data_iterator, timers=None,
               microbatches=None, validator=None, trace=None):
    """One optimizer step over ``microbatches`` (default: a full global batch's). Returns (losses, ok, grad_norm).

    ``comm`` is the run's :func:`pipe_comm`; ``comm.state`` is the ParallelState; ``timers`` (a
    :class:`~megatron_lite.training.timers.Timers`, optional) times the phases. ``validator`` (a
    :class:`~megatron_lite.training.rerun.ResultValidator`, optional) checks the result before the
    optimizer step and may rerun the forward-backward (``data_iterator`` then is the one its
    ``begin_step`` returned). ``trace`` (optional) records the schedule's ops (``--log-straggler``).
    """
    state, m = comm.state, microbatches or num_microbatches(config)
    timers = timers or Timers(0, get_device())
    # a module-level function, not a closure: an error's traceback keeps each frame's function, and a
    # closure's cells would keep the model (and its process groups) alive after the frames are cleared
    args = (config, comm, chunks, optimizer, forward_step_func, data_iterator, timers, m, trace)
    reported = _forward_backward_and_grads(*args)
    if validator is not None:  # --rerun-mode validate_results: may run the forward-backward again
        reported = validator.validate(reported, chunks, partial(_forward_backward_and_grads, *args))
    if config.precision.fp8_format is not None:  # delayed FP8 scaling: the once-per-step scale update
        update_fp8_scales(chunks, data_parallel_group=state.dp_cp_group,
                          expert_data_parallel_group=state.expert_dp_group)
    scale_grads_by_tokens(config, chunks, state, getattr(reported, "num_tokens", 0))  # --calculate-per-token-loss
    if config.moe.num_experts:
        finish_moe_step(chunks)  # expert-bias update from this step's token counts
    with timers.phase("optimizer"), torch.profiler.record_function("optimizer_step"):
        ok, grad_norm = optimizer.step()
    empty_unused_memory(config.training.empty_unused_memory_level, 2)
    with timers.phase("lr-scheduler"):
        if ok:
            scheduler.step(1)
    timers.iterations += 1
    return reduce_reported(reported, state), ok, grad_norm


def evaluate(config, comm, chunks, forward_step_func, data_iterator, iterations: int | None = None) -> dict[str, float]:
    """Forward-only passes over ``iterations`` (default ``eval_iters``) global batches; mean reported losses."""
    state = comm.state
    for chunk in chunks:
        chunk.eval()
    forward_backward = get_forward_backward_func(state, config.parallel.pipeline_schedule)
    per_iteration = []  # each iteration's reported losses
    with torch.no_grad():
        for _ in range(config.training.eval_iters if iterations is None else iterations):
            per_iteration.append(forward_backward(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=chunks,
                num_microbatches=num_microbatches(config), comm=comm, forward_only=True,
            ))
            empty_unused_memory(config.training.empty_unused_memory_level, 1)
    for chunk in chunks:
        chunk.train()
    return evaluation_losses(per_iteration, state)
