"""Validation's own batch sizes and start: ``--eval-global-batch-size``, ``--eval-micro-batch-size``,
``--start-eval-at-iter`` (Megatron-LM's flags).

One validation (or test) iteration reads ``--eval-global-batch-size`` samples (default
``--global-batch-size``) as ``eval-global-batch-size / (eval-micro-batch-size x data-parallel size)``
micro-batches of ``--eval-micro-batch-size`` samples (default ``--micro-batch-size``) on every
data-parallel rank, run forward-only through the pipeline schedule (a pipeline's stages pass
activations of the eval micro-batch's shape). A pass is ``--eval-iters`` such iterations (or, with
``--full-validation``, as many full eval global batches as the dataset holds); the validation position
saved with checkpoints advances by ``eval-iters x eval-global-batch-size``.

:func:`eval_config` is the run's config as validation reads it (the training batch flags replaced by
the eval ones), so every function that sizes a validation pass from ``config.training`` (the
micro-batch count, the data iterators, the sample counts) takes it unchanged.
"""

from __future__ import annotations

import copy
import dataclasses

from ..errors import ConfigError


def eval_sizes(config) -> tuple[int, int]:
    """(eval global batch, eval micro-batch): the flags, or the training ones where not given."""
    t = config.training
    gbs = t.eval_global_batch_size if t.eval_global_batch_size is not None else t.global_batch_size
    mbs = t.eval_micro_batch_size if t.eval_micro_batch_size is not None else t.micro_batch_size
    return gbs, mbs


def eval_config(config):
    """``config`` with the training batch flags replaced by validation's (itself when neither eval flag is given)."""
    t = config.training
    if t.eval_global_batch_size is None and t.eval_micro_batch_size is None:
        return config
    gbs, mbs = eval_sizes(config)
    out = copy.copy(config)
    out.training = dataclasses.replace(t, global_batch_size=gbs, micro_batch_size=mbs, rampup_batch_size=None,
                                       decrease_batch_size_if_needed=False)
    return out


def evaluates_at(config, iteration: int) -> bool:
    """Whether the --eval-interval pass runs after ``iteration`` (--start-eval-at-iter holds it back before)."""
    t = config.training
    start = t.start_eval_at_iter
    return iteration % t.eval_interval == 0 and (start is None or iteration >= start)


def check_eval_batch_flags(config) -> None:
    """The command line's refusals for the eval batch flags and --start-eval-at-iter (one line each)."""
    t, dp = config.training, config.data_parallel_size
    if t.start_eval_at_iter is not None and t.start_eval_at_iter < 0:
        raise ConfigError(f"--start-eval-at-iter must be at least 0, got {t.start_eval_at_iter}")
    for flag, value in (("--eval-global-batch-size", t.eval_global_batch_size),
                        ("--eval-micro-batch-size", t.eval_micro_batch_size)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
    if t.eval_global_batch_size is None and t.eval_micro_batch_size is None:
        return
    gbs, mbs = eval_sizes(config)
    if gbs % (mbs * dp):
        flag = "--eval-global-batch-size" if t.eval_global_batch_size is not None else "--eval-micro-batch-size"
        raise ConfigError(f"{flag}: the eval global batch {gbs} is not divisible by the eval micro-batch {mbs} x "
                          f"data-parallel size {dp}; give --eval-global-batch-size a multiple of {mbs * dp}")
    from ..parallel.pipeline.partition import interleaved

    pp = config.parallel.pipeline_model_parallel_size
    if interleaved(config.flat()) and (gbs // (mbs * dp)) % pp:
        raise ConfigError(f"--eval-global-batch-size {gbs}: the interleaved pipeline schedule needs the eval "
                          f"micro-batches (eval global batch / (eval micro-batch {mbs} x data-parallel size {dp}) = "
                          f"{gbs // (mbs * dp)}) to be a multiple of --pipeline-model-parallel-size {pp}")
