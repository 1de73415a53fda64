"""Result validation by rerunning a step (``--rerun-mode validate_results``): the core of Megatron-LM's
rerun state machine, which tells a transient hardware fault (silent data corruption) from a result
the data or the model really gives.

Each step's result is checked before the optimizer step, on every rank:

* fatal checks (``--check-for-nan-in-loss-and-grad``, on by default): a NaN or inf in a micro-batch's
  loss (last pipeline stage) or in this rank's gradient norm (not under ``--fp16``, whose loss scaler
  owns overflowing gradients);
* non-fatal checks: ``--check-for-spiky-loss``, a micro-batch loss of at least 10 times the largest of
  the first 100 seen; ``--check-for-large-grads``, this rank's gradient norm at least 10 times the
  largest of the first 100 steps' (Megatron-LM's factors and sample counts; NaN/inf values are left
  to the fatal checks).

As in Megatron-LM, nothing is checked in a run's first step (its references start at the second).
When a check fails on any rank (one all-reduce per step decides for every rank), every rank runs the
step's forward and backward again on the same micro-batches (the data iterator's items are kept by
reference while the step runs: no tensor is copied unless a rerun happens) from the same generator
states, and compares: each loss exactly, the gradient norm within 0.1% (Megatron-LM's tolerances).

* The rerun differs somewhere: a transient fault. A fatal check stops every rank with
  :data:`EXIT_CODE_FAILED_ON_RESULT_VALIDATION` (17, Megatron-LM's code for a failed validation) in
  one line, saving nothing of this step (restart from the last checkpoint, on other hardware if it
  recurs); a non-fatal check goes on with the rerun's result.
* The rerun reproduces it: a spiky loss or large gradients are trained on (Megatron-LM's non-fatal
  checks go on). A NaN/inf goes to Megatron-LM's second stage (:mod:`.rerun_resume`): with ``--save``
  the checkpoint before the step is saved with the step to rerun and every rank exits 16
  (:data:`EXIT_CODE_RESUME_TO_DISAMBIGUATE`), so that the restarted job reruns it on other hardware and
  exits 17 with the verdict; without ``--save`` it stops the run as ``--check-for-nan-in-loss-and-grad``
  does without reruns (exit 1).

``--result-rejected-tracker-filename`` lists every rejected result and its reruns' verdicts
(:mod:`.rerun_tracker`); the iterations it says to skip join ``--iterations-to-skip``.
``--error-injection-rate N`` injects a failed check about once every N checked steps per rank
(``--error-injection-type``: the rerun then differs, ``transient_error``; reproduces a wrong result
that other hardware does not, ``persistent_error``; or reproduces a right one, ``correct_result``:
both fatal ones go to the second stage, and without ``--save`` a persistent error stops as on a NaN
and a correct result is trained on).
"""

from __future__ import annotations

import math
import os
import random

import torch
import torch.distributed as dist

from ..console import print_rank_0
from ..device import get_device
from ..errors import ConfigError
from ..optim.clip_grads import grad_of
from ..parallel.random import rng_states, set_rng_states
from .exit_signal import any_rank
from .nonfinite import NonFiniteError
from .rerun_tracker import append_lines, tracker_line, tracker_skips

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16  # Megatron-LM's "restart to rerun the step on other hardware" exit
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17  # Megatron-LM's exit after a result failed validation
LARGE_FACTOR = 10.0  # a spiky loss / large gradient norm: at least this times the reference
REFERENCE_SAMPLES = 100  # values whose largest is the reference
GRAD_TOLERANCE = 1e-3  # relative difference of a rerun's gradient norm still counted as the same


class StopEveryRank(RuntimeError):
    """A stop every rank raises together, with its own exit code (the training scripts print the
    message once and exit with ``exit_code``)."""

    on_every_rank = True
    exit_code = 1


class TransientFaultError(StopEveryRank):
    """A rejected result the rerun did not reproduce; every rank raises it together."""

    exit_code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION


class ResultRejectedError(StopEveryRank):
    """The rerun on other hardware (after exit 16) gave its verdict on a rejected result."""

    exit_code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION


class ResumeToDisambiguateError(StopEveryRank):
    """A rejected result reproduced on the same hardware: saved, to be rerun on other hardware."""

    exit_code = EXIT_CODE_RESUME_TO_DISAMBIGUATE


class ReplayIterator:
    """Passes a data iterator's items through, keeping references to this step's (no copy) so that
    :meth:`rewind` replays them."""

    def __init__(self, iterator):
        self.iterator, self.items, self.pos = iterator, [], None

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos is not None and self.pos < len(self.items):
            self.pos += 1
            return self.items[self.pos - 1]
        item = next(self.iterator)
        self.items.append(item)
        return item

    def rewind(self) -> None:
        self.pos = 0


class LargeValues:
    """Megatron-LM's reference for "unexpectedly large": the largest of the first ``samples`` finite
    values; after them a value at least ``factor`` times it is rejected."""

    def __init__(self, factor: float = LARGE_FACTOR, samples: int | None = None):
        self.factor, self.count, self.largest = factor, 0, 0.0
        self.samples = REFERENCE_SAMPLES if samples is None else samples

    def rejects(self, value: float) -> bool:
        value = abs(value)
        if not math.isfinite(value):
            return False
        if self.count < self.samples:
            self.count += 1
            self.largest = max(self.largest, value)
            return False
        return value >= self.largest * self.factor


def _loss_values(reported) -> list[float]:
    """Each micro-batch's first reported loss (a per-token ``[sum, count]`` pair as sum / count), read
    in one transfer."""
    if not reported:
        return []
    values = torch.stack([next(iter(r.values())).detach().double().reshape(-1) for r in reported])
    if values.shape[1] == 2:
        return (values[:, 0] / values[:, 1].clamp(min=1)).tolist()
    return values[:, 0].tolist()


def local_grad_norm(chunks) -> float:
    """L2 norm of the gradients this rank holds (its shard under sharded gradients): one pass over each
    chunk's flat fp32 gradient buffer where it has one (its padding stays zero), else over the parameters."""
    norms = []
    for chunk in chunks:
        flat = getattr(chunk, "grad_shards" if getattr(chunk, "shard_grads", False) else "grad_buffer", None)
        if flat is not None:
            norms.append(torch.linalg.vector_norm(flat.detach()))
            continue
        norms.extend(g.detach().float().norm() for g in map(grad_of, chunk.parameters()) if g is not None)
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def _same(a: float, b: float, tolerance: float) -> bool:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


class ResultValidator:
    """One run's result checks and reruns (see the module docstring). ``begin_step`` before the
    step's forward-backward, ``validate`` after its gradients are final and before the optimizer step."""

    def __init__(self, config, state):
        t = config.training
        self.rng_tracker, self.iteration = state.rng_tracker, 0  # not the state: its groups must go with the run
        self.fatal = t.check_for_nan_in_loss_and_grad
        self.grads_fatal = self.fatal and not config.precision.fp16
        self.spiky = LargeValues() if t.check_for_spiky_loss else None
        self.large = LargeValues() if t.check_for_large_grads else None
        self.enabled = t.rerun_mode == "validate_results" and (self.fatal or self.spiky or self.large)
        self.injection_rate, self.injection_type = t.error_injection_rate, t.error_injection_type
        self.draws = random.Random(t.seed)  # its own stream: the training's generators are not touched
        self.first_step = True
        self.replays: list[ReplayIterator] = []
        self.saved_rng = None
        self.reruns = 0
        self.tracker = t.result_rejected_tracker_filename
        self.skips = set(t.iterations_to_skip) | set(shared_tracker_skips(self.tracker))
        self.stage2 = None  # rerun_resume.SecondStage: the save for exit 16 and the rerun after it

    def begin_step(self, data_iterator, iteration: int):
        """The step's data iterator(s), wrapped to be replayed; the generator states are kept."""
        self.iteration = iteration
        if not self.enabled:
            return data_iterator
        self.saved_rng = rng_states(self.rng_tracker)
        many = isinstance(data_iterator, list)
        self.replays = [None if it is None else ReplayIterator(it) for it in (data_iterator if many else [data_iterator])]
        return self.replays if many else self.replays[0]

    def _inject(self) -> bool:
        """Megatron-LM's draw: one in ``rate`` on average, shifted by the rank."""
        if self.injection_rate <= 0:
            return False
        rank = dist.get_rank() if dist.is_initialized() else 0
        return (self.draws.randint(0, self.injection_rate - 1) + rank) % self.injection_rate == 0

    def values(self, reported, chunks) -> list[float]:
        """What a rerun is compared on: each micro-batch's loss, this rank's gradient norm."""
        return [*_loss_values(reported), local_grad_norm(chunks) if (self.grads_fatal or self.large) else 0.0]

    def _checks(self, reported, chunks) -> tuple[bool, bool, bool, list[float]]:
        """(a fatal check failed here, on a loss, a non-fatal one failed, the values a rerun is compared on)."""
        *losses, norm = self.values(reported, chunks)
        loss_bad = self.fatal and any(not math.isfinite(v) for v in losses)
        fatal = loss_bad or (self.grads_fatal and not math.isfinite(norm))
        spiky = self.spiky is not None and any([self.spiky.rejects(v) for v in losses])
        large = self.large is not None and self.large.rejects(norm)
        return fatal, loss_bad, spiky or large, [*losses, norm]

    def validate(self, reported, chunks, rerun):
        """Check the step's result; on a failed check anywhere ``rerun()`` (forward, backward and
        gradient finalisation again; returns the new reported losses) on every rank, then decide.
        Returns the reported losses to log (the rerun's when it ran)."""
        if not self.enabled:
            return reported
        try:
            return self._validate(reported, chunks, rerun)
        finally:
            self.replays, self.saved_rng = [], None  # this step's batches and generator states let go

    def _validate(self, reported, chunks, rerun):
        if self.stage2 is not None and self.stage2.pending is not None:  # resumed after exit 16: the verdict
            self.stage2.second_rerun(self, self.values(reported, chunks))
        if self.first_step:  # as in Megatron-LM: the run's first step is not checked
            self.first_step = False
            return reported
        fatal, loss_bad, nonfatal, values = self._checks(reported, chunks)
        injected = None
        if not (fatal or nonfatal) and self._inject():
            injected = self.injection_type
            fatal, nonfatal = (True, False) if self.fatal else (False, True)
        any_fatal, any_loss_bad, any_nonfatal, any_injected = any_rank([fatal, loss_bad, nonfatal, injected is not None])
        if not (any_fatal or any_nonfatal):
            return reported
        # this rank's check failed at the source: a NaN/inf loss reaches every data-parallel replica's
        # gradients through the reduction, so only the ranks whose loss failed count then
        failed = (loss_bad if any_loss_bad else fatal) or nonfatal or injected is not None
        reported, differs = self._rerun(rerun, values, injected, chunks, failed, any_fatal)
        any_injected = self.injection_type if any_injected else None
        if any_fatal and not differs and self.stage2 is not None and self.stage2.can_save:
            self.stage2.save_and_exit(self, failed, values, self._what(any_fatal, any_injected), any_injected)
        return self._decide(reported, any_fatal, differs, any_injected)

    def _rerun(self, rerun, values, injected, chunks, failed, fatal):
        for replay in self.replays:
            if replay is not None:
                replay.rewind()
        set_rng_states(self.saved_rng, self.rng_tracker)
        for module in (m for chunk in chunks for m in chunk.modules()):  # a spec's logged losses: the rerun's only
            if isinstance(getattr(module, "aux_losses", None), dict):
                module.aux_losses = {}
        self.reruns += 1
        reported = rerun()
        differs = not same_values(values, self.values(reported, chunks))
        if injected is not None:  # the injected verdict replaces the comparison, as in Megatron-LM
            differs = injected == "transient_error"
        what = self._what(fatal, injected)
        self.track(failed, [("initial_run", values), ("first_rerun_" + ("not_" if differs else "") + "reproducible",
                                                       values)], what)
        return reported, any_rank([differs])[0]

    def track(self, failed: bool, events, what: str) -> None:
        """``--result-rejected-tracker-filename``: this rank's lines (when its check failed), every rank's
        written by rank 0 (collective)."""
        if self.tracker:
            where = host_and_device()
            rank = dist.get_rank() if dist.is_initialized() else 0
            loss = values_text(events[0][1])
            append_lines(self.tracker, [tracker_line(where, rank, self.iteration, status, loss, what)
                                        for status, _ in events] if failed else [])

    @staticmethod
    def _what(fatal: bool, injected) -> str:
        if injected is not None:
            return f"an injected {injected}"
        return "a NaN/inf loss or gradient" if fatal else "a spiky loss or large gradients"

    def _decide(self, reported, fatal: bool, differs: bool, injected):
        where = f"iteration {self.iteration + 1}"
        what = self._what(fatal, injected)
        if differs and fatal:
            raise TransientFaultError(
                f"{where}: the rerun of the step did not reproduce {what} (a transient fault, e.g. silent data "
                f"corruption): stopping without saving this iteration, exit code {EXIT_CODE_FAILED_ON_RESULT_VALIDATION}; "
                "restart from the last checkpoint (on other hardware if it recurs)")
        if fatal and injected == "persistent_error":
            raise NonFiniteError(f"{where}: the rerun of the step reproduced {what}: stopping without saving this "
                                 "iteration (--rerun-mode disabled does not rerun)")
        verdict = "did not reproduce it (transient); training goes on with the rerun's result" if differs else \
            "reproduced it; training goes on"
        if not fatal or injected == "correct_result":
            print_rank_0(f"> {where}: result check failed ({what}); the rerun of the step {verdict}")
        return reported  # a reproduced NaN/inf: the step goes on to the non-finite check, which stops the run



def same_values(values: list[float], again: list[float]) -> bool:
    """A rerun's values are the same: the losses exactly, the gradient norm (last) within GRAD_TOLERANCE."""
    tolerances = [0.0] * (len(values) - 1) + [GRAD_TOLERANCE]
    return len(again) == len(values) and all(_same(a, b, tol) for a, b, tol in zip(values, again, tolerances))


def values_text(values: list[float]) -> str:
    return "[" + ",".join(f"{v:.6g}" for v in values) + "]"


def host_and_device() -> tuple[str, str]:
    """(node, device) this rank runs on: what the rerun after exit 16 must not run on again."""
    device = get_device()
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return os.uname()[1], str(device)


def shared_tracker_skips(path: str | None) -> list[int]:
    """The tracker file's iterations to skip, read by rank 0 and given to every rank (one file need not be
    visible to every node); its error is every rank's."""
    if not path or not dist.is_initialized():
        return tracker_skips(path)
    answer = [None]
    if dist.get_rank() == 0:
        try:
            answer = [tracker_skips(path)]
        except ConfigError as err:
            answer = [str(err)]
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise ConfigError(answer[0])
    return answer[0]


def skip_step_data(train_iter, microbatches: int, iteration: int) -> None:
    """``--iterations-to-skip``: read and drop the step's micro-batches from every model chunk's iterator
    (as Megatron-LM does: the step's samples count as consumed, no update, no learning-rate step)."""
    for it in train_iter if isinstance(train_iter, list) else [train_iter]:
        for _ in range(microbatches if it is not None else 0):
            next(it)
    print_rank_0(f"> iteration {iteration + 1} skipped (--iterations-to-skip {iteration}): its global batch is "
                 "read and not trained on")

