"""The training loop shared by the pretrain scripts.

``pretrain(config, model_provider, forward_step_func, datasets_provider)`` does, in order:
initialise distributed and the parallel state, seed the RNGs, build the model chunks (wrapped for
data parallelism), the optimizer and the learning-rate schedule, load a checkpoint, build the data
iterators at the consumed-samples position, then train: one ``train_step`` (``step.py``) per iteration (all
micro-batches through the pipeline schedule, gradient finalisation, one optimizer step), logging,
evaluation, checkpointing and the exit conditions (SIGTERM, duration, interval).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time

import torch.distributed as dist

from ..checkpoint import save_checkpoint
from ..checkpoint.dist_save import AsyncSaves
from ..checkpoint.retention import after_save
from ..checkpoint_config import non_persistent_dir
from ..config import Config
from ..console import print_rank_0
from ..device import get_device
from ..distributed_flags import deterministic_mode
from ..errors import ConfigError, rank_local_errors
from ..moe.metrics import moe_step_values, plugin_loss_values
from ..optim.lr_scheduler import build_scheduler
from ..parallel.state import ParallelState
from ..perf.comm_volume import CommVolume
from ..perf.flops import num_floating_point_operations
from ..perf.memory_tracker import MemoryReport
from ..perf.model_state import model_state_report
from ..schedule_checks import check_train_iters
from .batch_rampup import StepBatches, data_config_for_resume, valid_config_for_resume, validation_batch
from .build import Built, build_run, resumed_validation
from .eval_batch import eval_config, evaluates_at
from .exit_signal import ExitSignal, any_rank
from .logging import TrainLogger
from .manual_gc import ManualGC
from .nonfinite import check_finite
from .outputs import check_output_locations, interrupted_note
from .profiler import StepProfiler
from .progress import ProgressLog
from .rerun import ResultValidator, skip_step_data
from .rerun_resume import attach_second_stage
from .result import TrainResult
from .startup import setup
from .step import evaluate, pipe_comm, train_step
from .step_stats import step_stats
from .straggler import StragglerDetector
from .timers import Timers
from .validation import ValidationSets
from .weight_hash import check_weight_hashes
from .writers import check_wandb_available


def _in_save(ck, iteration: int, loaded_from: str | None = None) -> bool:
    """Whether ``--save`` holds ``iteration`` as the run starts: the checkpoint just loaded from that
    folder (or iteration 0 of a --load). One loaded from another folder is not there: a run with
    nothing left to train writes it to --save at the end (Megatron-LM's final save writes it too
    unless --save-interval divides it, when it assumes the iteration was saved there already). One
    resumed from the non-persistent folder is not a persistent checkpoint: the final save writes it."""
    if not ck.load:
        return False
    if loaded_from is not None and iteration and os.path.realpath(loaded_from) != os.path.realpath(ck.load):
        return False
    return iteration == 0 or not ck.save or os.path.realpath(ck.load) == os.path.realpath(ck.save)


class _Training:
    """The loop of one ``pretrain`` run once everything is built: the iteration counters, the
    logger, the result being filled in, and the steps of one iteration (train, validate, save, exit
    check)."""

    def __init__(self, config: Config, state: ParallelState, built: Built, forward_step_func, train_iter, valid_iter,
                 exit_signal: ExitSignal | None = None, started: float | None = None, consumed_valid: int = 0):
        self.config, self.state, self.forward_step_func = config, state, forward_step_func
        self.chunks, self.optimizer, self.scheduler, self.iteration, self.consumed = built[:5]  # see consumed_valid
        self.consumed_valid = consumed_valid  # validation samples read so far (saved with the checkpoints)
        self.timers = Timers(config.logging.timing_log_level, get_device())
        self.train_iter = ([self.timers.timed_iterator(it) for it in train_iter] if isinstance(train_iter, list)
                           else self.timers.timed_iterator(train_iter))
        self.valid_iter = valid_iter
        t = config.training
        self.comm = pipe_comm(config, state)  # one communicator for every training schedule call of the run
        self.eval_config = eval_config(config)  # --eval-global-batch-size / --eval-micro-batch-size
        self.eval_comm = self.comm if self.eval_config is config else pipe_comm(self.eval_config, state)
        flops = num_floating_point_operations(config.model, t.global_batch_size, moe_config=config.moe)  # no recompute
        self.logger = TrainLogger(config, state, flops, start_consumed_samples=self.consumed)
        self.progress = ProgressLog(config, flops, self.consumed)  # --log-progress: <save>/progress.txt
        self.result = TrainResult(iteration=self.iteration, consumed_samples=self.consumed)
        self.exit_signal = exit_signal or ExitSignal(t.exit_signal_handler)
        self.start = time.time() if started is None else started  # --exit-duration-in-mins counts the start-up too
        self.saved_at = self.iteration if _in_save(config.checkpoint, self.iteration, built.loaded_from) else None
        self.volume = CommVolume() if config.logging.log_comm_volume else None
        self.memory = MemoryReport(self.chunks, self.optimizer) if config.logging.memory_report else None
        self.result.memory = self.memory.steps_seen if self.memory is not None else []
        self.async_saves = AsyncSaves(functools.partial(after_save, config)) if config.checkpoint.async_save else None
        self.batches = StepBatches(config, self.consumed)  # --rampup-batch-size: each step's global batch
        self.profiler = StepProfiler(config.logging, dist.get_rank() if dist.is_initialized() else 0, get_device(),
                                     self.iteration)
        self.gc = ManualGC(t)  # --manual-gc: the collector off, run at fixed points
        self.state_reported = False  # the model-state bytes line, printed after the first update
        self.validator = ResultValidator(config, state)  # --rerun-mode validate_results: checks, reruns
        attach_second_stage(self)  # exit 16's save, and the rerun on other hardware after it
        self.straggler = StragglerDetector(config.logging, state, flops, t.global_batch_size)  # last: rank 0's server

    def save(self, non_persistent: bool = False) -> None:
        """Save a checkpoint with ``--save`` (``non_persistent``: into the non-persistent folder), unless this
        iteration's is already saved (or loaded); then delete the older ones the flags do not keep."""
        ck = self.config.checkpoint
        if not ck.save or self.saved_at == self.iteration:
            return
        root = non_persistent_dir(ck, ck.save) if non_persistent else ck.save
        save_checkpoint(self.iteration, self.chunks, self.optimizer, self.scheduler, self.consumed,
                        self.config, self.state, self.async_saves, self.consumed_valid, root=root)
        if self.async_saves is None:
            after_save(self.config, root, self.iteration)
        if not non_persistent:
            self.saved_at = self.iteration
            self.progress.saved(self.iteration, self.consumed)

    def train_iteration(self) -> None:
        """One ``train_step`` and its bookkeeping: counters, the result's lists, the log line."""
        result = self.result
        micro, batch = self.batches.before_step(self)  # may save first: the batch size changes now
        if self.iteration in self.validator.skips:  # --iterations-to-skip, the tracker file's: read, train nothing
            skip_step_data(self.train_iter, micro, self.iteration)
            self.iteration, self.consumed = self.iteration + 1, self.consumed + batch
            return
        step_start = time.time()
        self.profiler.before(self.iteration)
        with contextlib.ExitStack() as tracking:
            if self.volume is not None:
                tracking.enter_context(self.volume.counting())
            if self.memory is not None:
                tracking.enter_context(self.memory.tracking())
            data = self.validator.begin_step(self.train_iter, self.iteration)  # replayable while the step runs
            losses, ok, grad_norm = train_step(self.config, self.comm, self.chunks, self.optimizer, self.scheduler,
                                               self.forward_step_func, data, self.timers, micro, self.validator,
                                               trace=self.straggler.step_trace())
        self.iteration += 1
        self.profiler.after(self.iteration)
        if self.memory is not None:
            for line in self.memory.after_step(self.iteration):
                print_rank_0(f"> {line}")
        if self.async_saves is not None:  # a background save that is done gets its tracker now
            self.async_saves.poll()
        if ok and not self.state_reported:  # Adam's moments exist from the first update on (fp16 skips some)
            self.state_reported = True
            print_rank_0(f"> {model_state_report(self.config, self.chunks, self.optimizer, self.state.dp_size * self.state.cp_size)}")
        if self.volume is not None:
            result.comm_volume.append(self.volume.end_step())
            if self.iteration % self.config.logging.log_interval == 0:
                print_rank_0(f" rank 0 {CommVolume.format(result.comm_volume[-1])} in iteration {self.iteration}")
        self.consumed += batch
        loss_value = next(iter(losses.values()), float("nan"))
        moe_losses, moe_scalars = {}, {}
        if self.config.moe.num_experts:  # collective: the routers' losses of this step
            moe_losses, moe_scalars = moe_step_values(self.chunks, self.state, self.config, micro)
        if self.config.model.spec:  # collective: the auxiliary losses a spec's modules log (moe/metrics.py)
            plugin = plugin_loss_values(self.chunks, self.state, micro)
            losses = {**losses, **plugin} if losses else losses
        is_nan = bool(losses) and not math.isfinite(loss_value)
        result.skipped_iterations += 0 if ok else 1
        if losses:
            result.losses.append(loss_value)
            result.reported.append(losses)
        result.grad_norms.append(grad_norm)
        result.stats.append(step_stats(self.config, self.optimizer, self.state, ok))  # collective when asked
        self.logger.log_iteration(
            self.iteration, {**losses, **moe_losses} if losses else losses, lr=self.scheduler.get_lr(), grad_norm=grad_norm,
            loss_scale=self.optimizer.get_loss_scale(), skipped=not ok, nan=is_nan,
            iter_time_s=time.time() - step_start, batch_size=batch, consumed_samples=self.consumed, extra_scalars=moe_scalars,
            **result.stats[-1])  # --log-params-norm, --log-num-zeros-in-grad
        if self.timers.level > 0 and self.iteration % self.config.logging.log_interval == 0:
            self.logger.log_timers(self.iteration, self.timers.take())
        self.straggler.after_step(batch, self.iteration)  # --log-straggler: a collective every log interval
        check_finite(self.config, self.state, self.iteration, loss_value if losses else None, grad_norm)
        self.gc.after_step(self.iteration)

    def validate(self, record: bool = True) -> None:
        """Evaluate on the validation iterator (or each of the :class:`ValidationSets`) and log it;
        ``record`` also keeps the (first set's) loss in the result's ``validation``."""
        sets = self.valid_iter
        with self.gc.evaluation():
            if isinstance(sets, ValidationSets):
                results = [(s.name, evaluate(self.eval_config, self.eval_comm, self.chunks, self.forward_step_func,
                                             s.pass_iterator(), s.batches)) for s in sets]
            else:
                results = [(None, evaluate(self.eval_config, self.eval_comm, self.chunks, self.forward_step_func, sets))]
        if not getattr(sets, "full", False):  # a --full-validation pass leaves the --eval-iters position alone
            self.consumed_valid += self.config.training.eval_iters * validation_batch(self.eval_config)
        for name, val in results:
            self.logger.log_validation(self.iteration, val, name=name)
            if val:
                self.result.evaluations.append((self.iteration, "validation" + ("" if name is None else f" {name}"), val))
        first = results[0][1]
        if record and first:
            self.result.validation.append((self.iteration, next(iter(first.values()))))

    def test(self, test_iter) -> None:
        """The test split's pass (Megatron's do_test), printed only: a ValidationSet or a provider's own iterator."""
        with self.gc.evaluation():
            test = evaluate(self.eval_config, self.eval_comm, self.chunks, self.forward_step_func,
                            getattr(test_iter, "iterator", test_iter), getattr(test_iter, "batches", None))
        self.logger.log_validation(self.iteration, test, prefix=f"iteration {self.iteration} on test set", scalars=False)
        if test:
            self.result.evaluations.append((self.iteration, "test", test))

    def evaluate_only(self, test_iter) -> TrainResult:
        """--skip-train: validation, then the test split (where it has data), at the loaded iteration; no step, no save."""
        print_rank_0(f"> --skip-train: no training step; evaluating the iteration-{self.iteration} model"
                     + (" (no checkpoint is written)" if self.config.checkpoint.save else ""))
        if self.valid_iter is None and test_iter is None:
            raise ConfigError("--skip-train: the data gives neither a validation nor a test split to evaluate; give "
                              "--split with a validation weight (or --valid-data-path)")
        if self.valid_iter is not None:
            self.validate()
        if test_iter is not None:
            self.test(test_iter)
        self.logger.close()
        self.gc.close()
        self.straggler.close()
        self.result.chunks, self.result.state, self.result.optimizer = self.chunks, self.state, self.optimizer
        self.result.exit_reason = "skip-train"
        return self.result

    def exit_reason(self) -> str | None:
        """Why the run stops after this iteration ("signal", "duration", "interval"), or None."""
        t = self.config.training
        reason = None
        if t.exit_signal_handler or t.exit_duration_in_mins:  # one small all-reduce, only when asked (0: no limit)
            signalled, out_of_time = any_rank([
                self.exit_signal.received,
                bool(t.exit_duration_in_mins) and (time.time() - self.start) / 60 > t.exit_duration_in_mins,
            ])
            reason = "signal" if signalled else "duration" if out_of_time else None
        interval = reason is None and t.exit_interval and self.iteration % t.exit_interval == 0
        return "interval" if interval else reason

    def run(self, test_iter=None) -> TrainResult:
        """Iterate until ``--train-iters`` or an exit condition; save, validate and test at the end."""
        try:
            with rank_local_errors(), contextlib.closing(self.gc), contextlib.closing(self.straggler):
                self._iterate(test_iter)  # rank_local_errors: e.g. a bad batch read by one rank
        except Exception:
            # the save in flight is finished (or discarded) first, as a synchronous one would be, not left
            # half-written by the exit: for a stop every rank takes together (a NaN loss) and for an error
            # one rank meets alone (a bad batch). The writers need no main thread, so the others' writers
            # finish it with this one's while their main threads wait for this rank in a collective; a
            # rank whose collective failed (a peer gone) finds its writer done or failing at once
            if self.async_saves is not None:
                self.async_saves.wait()
            raise
        except KeyboardInterrupt as err:  # Ctrl-C: errors.run_script prints what was saved in one line
            err.where = interrupted_note(self.config.checkpoint.save, self.saved_at, self.iteration,
                                         self.async_saves is not None)
            raise
        if self.async_saves is not None:  # the last save's failure stops the run, as a failed save does
            self.async_saves.wait(final=True)
        self.profiler.close()  # the run ended inside the profiling window
        self.logger.close()
        for chunk in self.chunks:  # --overlap-param-gather: the last step's all-gathers land before returning
            chunk.finish_param_gather()
        self.result.iteration, self.result.consumed_samples = self.iteration, self.consumed
        self.result.chunks, self.result.state, self.result.optimizer = self.chunks, self.state, self.optimizer
        return self.result

    def _iterate(self, test_iter) -> None:
        t, ck = self.config.training, self.config.checkpoint
        evaluating = t.eval_iters > 0 and self.valid_iter is not None
        hash_every = t.check_weight_hash_across_dp_replicas_interval  # the replicas' weights compared, first now
        if hash_every:
            check_weight_hashes(self.chunks, self.state, self.iteration)
        while self.iteration < t.train_iters:
            self.train_iteration()
            if hash_every and self.iteration % hash_every == 0:
                check_weight_hashes(self.chunks, self.state, self.iteration)
            if evaluating and evaluates_at(self.config, self.iteration):
                self.validate()
            if ck.save_interval and self.iteration % ck.save_interval == 0:
                self.save()
            elif ck.non_persistent_save_interval and self.iteration % ck.non_persistent_save_interval == 0:
                self.save(non_persistent=True)
            reason = self.exit_reason()
            if reason:
                print_rank_0(f"> exit on {reason}")
                self.save()
                self.result.exit_reason = reason
                break
        if self.result.exit_reason == "done":
            self.save()
            if evaluating and not evaluates_at(self.config, self.iteration):  # not just validated
                self.validate(record=False)
            if t.eval_iters > 0 and test_iter is not None:  # a run stopped early (signal, duration) does not test
                self.test(test_iter)


def pretrain(config: Config, model_provider, forward_step_func, datasets_provider,
             scheduler_provider=build_scheduler) -> TrainResult:
    """Train ``model_provider(config, state)`` (a list of model chunks) as the flags say.

    ``datasets_provider(config, state, consumed_train_samples, consumed_valid_samples)`` returns
    ``(train_iterator, valid_iterator)``; each may be a list with one iterator per model chunk, and
    the validation one a :class:`~megatron_lite.training.validation.ValidationSets`. A third item, a
    test iterator, is evaluated (``--eval-iters`` batches) once, at the end of a run that trained to
    ``--train-iters`` and by a ``--skip-train`` run (Megatron-LM's test pass).
    ``scheduler_provider(config, optimizer)`` returns the learning-rate schedule (default: the flags',
    :func:`build_scheduler`): an object with ``step(increment)`` (called once per optimizer step; it
    sets the optimizer's lr), ``get_lr()``, ``state_dict()`` and ``load_state_dict(sd)``, saved and
    restored with checkpoints like the default one (one without them is refused before any step); a
    subclass of ``OptimizerParamScheduler`` overriding ``get_lr`` is the simplest.
    """
    started = time.time()  # --exit-duration-in-mins counts from here: start-up and checkpoint load included
    check_train_iters(config)  # the command line's refusal, for a Config made or changed in code
    exit_signal = ExitSignal(config.training.exit_signal_handler)  # first: a SIGTERM during start-up counts
    with contextlib.closing(exit_signal):  # the process's own SIGTERM handler is given back at return
        check_output_locations(config)  # before any step, not at the first save
        check_wandb_available(config)  # before the model is built: the package and a login (or offline mode)
        with deterministic_mode(config.training.deterministic_mode):  # undone when the run returns
            state, device = setup(config)
            built = build_run(config, state, device, model_provider, scheduler_provider)
            consumed_valid = resumed_validation(config, built)
            data_config = data_config_for_resume(config, built.iteration, built.consumed_samples)
            data_config = valid_config_for_resume(data_config, built.iteration, consumed_valid)
            train_iter, valid_iter, *test = datasets_provider(data_config, state, built.consumed_samples, consumed_valid)
            training = _Training(config, state, built, forward_step_func, train_iter, valid_iter, exit_signal,
                                 started, consumed_valid)
            if config.training.skip_train:
                return training.evaluate_only(test[0] if test else None)
            return training.run(test[0] if test else None)
