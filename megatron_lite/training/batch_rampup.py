"""The global batch of each step: constant, or ramped up with ``--rampup-batch-size`` (Megatron-LM's flag).

``--rampup-batch-size START INCREMENT SAMPLES`` starts training at a global batch of START samples
and grows it by INCREMENT at a time until it reaches ``--global-batch-size`` G, spread evenly over
the first SAMPLES consumed samples: with ``n = (G - START) / INCREMENT`` increments, a step that
begins after ``c`` consumed samples trains on

* ``START + floor(c * n / SAMPLES) * INCREMENT`` samples while ``c <= SAMPLES``,
* G once ``c > SAMPLES``.

The step's micro-batch count is that batch over ``micro-batch-size x data-parallel size`` (every
batch of the ramp must divide evenly, or ``--decrease-batch-size-if-needed`` rounds each batch down
to a multiple); consumed samples, the sample-counted learning-rate schedule and the logged
``global batch size`` all advance by the batch actually trained on. Validation always runs full
global batches of G (rounded down likewise with ``--decrease-batch-size-if-needed``). The ramp
needs ``--train-samples``: the run's iterations are the ramp's steps (counted in full, as
Megatron-LM counts them) plus ``(train-samples - samples the ramp took) // G``.
"""

from __future__ import annotations

import copy
import dataclasses

from ..console import print_rank_0
from ..data.builder import train_valid_test_num_samples
from ..errors import ConfigError


def num_microbatches(config) -> int:
    """Micro-batches of a full global batch (``--global-batch-size``) on each data-parallel rank."""
    t = config.training
    return t.global_batch_size // (t.micro_batch_size * config.data_parallel_size)


def validation_batch(config) -> int:
    """Samples one validation iteration reads: :func:`num_microbatches` micro-batches on every
    data-parallel rank, so ``--global-batch-size`` rounded down with ``--decrease-batch-size-if-needed``."""
    return num_microbatches(config) * config.training.micro_batch_size * config.data_parallel_size


def end_at_train_samples(config, iteration: int, consumed: int) -> None:
    """--train-samples: a run resumed at ``iteration`` after ``consumed`` samples ends once the samples are
    trained (``train_iters`` = the iterations left at this --global-batch-size, which differs from
    --train-samples / --global-batch-size when the checkpoint was saved at another batch). With
    --rampup-batch-size, a checkpoint that consumed what this run's ramp consumes in ``iteration`` steps
    keeps the ramp's own count; one saved with other batch flags (another --global-batch-size or ramp)
    gets the steps this ramp takes from ``consumed`` on: counted from the start, they read past the
    training set (built for --train-samples: a StopIteration traceback) or stop short of it."""
    t = config.training
    if t.train_samples is None or not iteration:
        return
    if t.rampup_batch_size is None:
        t.train_iters = iteration + max(0, t.train_samples - consumed) // t.global_batch_size
        return
    schedule = BatchSchedule.from_config(config)
    ramp_consumed = schedule.consumed_after(iteration)
    if ramp_consumed == consumed:
        return
    t.train_iters = iteration + schedule.train_iters(t.train_samples, consumed)
    print_rank_0(f"> the checkpoint consumed {consumed} samples in {iteration} iterations, not the "
                 f"{ramp_consumed} of this run's batch ramp: the run ends at iteration "
                 f"{t.train_iters}, once --train-samples {t.train_samples} are trained")


def data_config_for_resume(config, iteration: int, consumed: int):
    """The config the datasets are built from for a run resumed at ``iteration`` after ``consumed``
    samples: ``config`` itself, or, where the rest of the run reads past the ``--train-iters`` x
    ``--global-batch-size`` samples the training set is built for (a checkpoint saved with a larger
    global batch: its consumed samples run ahead of this run's iteration count), a copy whose
    ``train_samples`` (the training set's size) covers them, so the data does not run out mid-run.
    With ``--train-samples`` (which the ramp needs) the run ends with the samples instead
    (:func:`end_at_train_samples` sets its iterations) and ``config`` is returned."""
    t = config.training
    if t.train_samples is not None:
        end_at_train_samples(config, iteration, consumed)
        return config
    needed = consumed + max(0, t.train_iters - iteration) * t.global_batch_size
    if needed <= t.train_iters * t.global_batch_size:
        return config
    print_rank_0(f"> the checkpoint consumed {consumed} samples in {iteration} iterations: the training data is "
                 f"built for {needed} samples (consumed + the {t.train_iters - iteration} iterations left x "
                 f"--global-batch-size {t.global_batch_size}), not --train-iters x --global-batch-size")
    resumed = copy.copy(config)
    resumed.training = dataclasses.replace(t, train_samples=needed)
    return resumed


def valid_config_for_resume(config, iteration: int, consumed_valid: int):
    """``config``, or a copy whose ``valid_samples`` (the validation set's size) covers a resumed run's
    validation: from ``consumed_valid`` (the checkpoint's position, recorded under other --eval-interval /
    --eval-iters) through the passes left, which the flags' count would not hold (it would wrap to the
    first samples)."""
    t = config.training
    if t.eval_iters <= 0 or not t.eval_interval:
        return config
    passes_left = t.train_iters // t.eval_interval - iteration // t.eval_interval + 1  # and the final one
    eval_batch = t.global_batch_size if t.eval_global_batch_size is None else t.eval_global_batch_size
    needed = consumed_valid + max(passes_left, 1) * t.eval_iters * eval_batch
    _, built_for, _ = train_valid_test_num_samples(t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters,
                                                   eval_global_batch_size=eval_batch)
    if needed <= built_for:
        return config
    resumed = copy.copy(config)
    resumed.training = dataclasses.replace(t, valid_samples=needed)
    return resumed


class BatchSchedule:
    """The global batch and micro-batch count of the step that starts after ``consumed`` samples."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup: list[int] | None = None, decrease_if_needed: bool = False):
        self.global_batch_size = global_batch_size
        self.unit = micro_batch_size * data_parallel_size  # one micro-batch on every data-parallel rank
        self.start, self.increment, self.samples = rampup if rampup else (global_batch_size, 1, 0)
        self.increments = (global_batch_size - self.start) // self.increment if rampup else 0
        self.decrease_if_needed = decrease_if_needed

    @classmethod
    def from_config(cls, config) -> BatchSchedule:
        t = config.training
        return cls(t.global_batch_size, t.micro_batch_size, config.data_parallel_size, t.rampup_batch_size,
                   t.decrease_batch_size_if_needed)

    def nominal(self, consumed: int) -> int:
        """The global batch the ramp asks for (before any rounding down)."""
        if not self.increments or consumed > self.samples:
            return self.global_batch_size
        return self.start + (consumed * self.increments // self.samples) * self.increment

    def batch(self, consumed: int) -> int:
        """The samples the step trains on: :meth:`nominal`, rounded down to a multiple of micro-batch
        x data-parallel size with ``--decrease-batch-size-if-needed``."""
        return self.nominal(consumed) // self.unit * self.unit

    def microbatches(self, consumed: int) -> int:
        return self.nominal(consumed) // self.unit

    def sizes(self) -> list[int]:
        """Every global batch of the ramp, START to --global-batch-size."""
        return [self.start + k * self.increment for k in range(self.increments + 1)]

    def train_iters(self, train_samples: int, consumed: int = 0) -> int:
        """Iterations for ``--train-samples`` from ``consumed`` samples on: the ramp's steps, then full
        batches (a last partial batch is dropped). A step is counted only when its (nominal) batch fits
        in what is left."""
        iters = 0
        while consumed <= self.samples and self.increments:
            size = self.nominal(consumed)
            if consumed + size > train_samples:
                return iters
            consumed, iters = consumed + size, iters + 1
        return iters + max(0, train_samples - consumed) // self.global_batch_size

    def consumed_after(self, steps: int) -> int:
        """Samples the training loop has consumed after ``steps`` steps of this schedule from the start
        (each step :meth:`batch` samples)."""
        consumed = 0
        while steps and consumed <= self.samples and self.increments:
            consumed, steps = consumed + self.batch(consumed), steps - 1
        return consumed + steps * self.batch(consumed)


def check_batch_rampup(config) -> None:
    """--rampup-batch-size's rules (one line naming the flag, exit 2); sets --train-iters from
    --train-samples the way the ramp consumes them. Runs after the train-length checks."""
    t = config.training
    if t.rampup_batch_size is None:
        return
    start, increment, samples = t.rampup_batch_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if t.train_samples is None:
        raise ConfigError(f"{flag} needs sample-based training: give --train-samples (and --lr-*-samples) "
                          "instead of --train-iters")
    if start < 1 or increment < 1 or samples < 1:
        raise ConfigError(f"{flag}: the start batch, increment and ramp-up samples must each be at least 1")
    gbs = t.global_batch_size
    if start > gbs or (gbs - start) % increment:
        raise ConfigError(f"{flag}: --global-batch-size {gbs} must be the start batch plus a whole number of "
                          f"increments (got {gbs} - {start} = {gbs - start}, not a multiple of {increment})")
    schedule = BatchSchedule.from_config(config)
    unit, dp = schedule.unit, config.data_parallel_size
    if t.decrease_batch_size_if_needed:
        if start < unit:
            raise ConfigError(f"{flag}: the start batch {start} is less than one micro-batch per data-parallel "
                              f"rank (--micro-batch-size {t.micro_batch_size} x data-parallel size {dp} = {unit})")
    else:
        bad = next((size for size in schedule.sizes() if size % unit), None)
        if bad is not None:
            raise ConfigError(f"{flag}: the ramp's global batch {bad} is not divisible by --micro-batch-size "
                              f"{t.micro_batch_size} x data-parallel size {dp}; make the start batch and the "
                              f"increment multiples of {unit}, or add --decrease-batch-size-if-needed")
    from ..parallel.pipeline.partition import interleaved

    if interleaved(config.flat()):  # every step's count, not only G's
        from ..parallel.pipeline.order import check_interleaved_microbatches

        for size in schedule.sizes():
            try:
                check_interleaved_microbatches(size // unit, config.parallel.pipeline_model_parallel_size)
            except ValueError as err:
                raise ConfigError(f"{flag}: at global batch {size}, {err}") from None
    t.train_iters = schedule.train_iters(t.train_samples)  # at least 1: --train-samples >= G >= START


class StepBatches:
    """The training loop's side: before each step, that step's micro-batch count and samples.

    As in Megatron-LM, when the count changes from the previous step's (not at the run's first step,
    nor at a resumed run's), a checkpoint is saved first with ``--save``; the change is printed.
    """

    def __init__(self, config, consumed: int):
        self.schedule = BatchSchedule.from_config(config)
        self.nominal = self.schedule.nominal(consumed)
        self.microbatches = self.schedule.microbatches(consumed)
        t = config.training
        if t.rampup_batch_size is not None:
            start, increment, samples = t.rampup_batch_size
            print_rank_0(f"> batch size ramp-up: global batch {start} to {t.global_batch_size} in steps of "
                         f"{increment} over {samples} samples; this run starts at {self.nominal}")

    def before_step(self, training) -> tuple[int, int]:
        """(micro-batches per data-parallel rank, global batch) of the step ``training`` is about to
        take (``training``: the loop's ``_Training``); sets the schedule's samples per step."""
        consumed = training.consumed
        nominal, microbatches = self.schedule.nominal(consumed), self.schedule.microbatches(consumed)
        if nominal != self.nominal:
            print_rank_0(f"> ramping up batch size from {self.nominal} to {nominal}")
        if microbatches != self.microbatches and training.iteration:
            training.save()
        self.nominal, self.microbatches = nominal, microbatches
        batch = self.schedule.batch(consumed)
        if getattr(training.scheduler, "unit", None) == "samples":  # the flags' schedule under --train-samples;
            training.scheduler.step_size = batch  # one of a script's own is stepped once per optimizer step
        return microbatches, batch
