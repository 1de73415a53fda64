"""Megatron-LM's second stage of result validation: a fatal result (a NaN/inf loss or gradient) that
the rerun on the same hardware reproduced is rerun on *other* hardware.

* Exit 16 (:data:`~megatron_lite.training.rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE`): with ``--save``
  (and the RNG states saved), the step is not taken; the checkpoint of the iteration before it is saved
  (or kept, when it is there already) with the generator states the step started from, and each rank
  writes ``rerun_state/rank_NNNNN.json`` into that checkpoint's folder: the iteration to rerun, whether
  this rank's check failed, the values it got (each micro-batch's loss, its gradient norm), the node and
  device it ran on and what failed. Every rank exits 16: the job is to be restarted from that checkpoint
  (``--load``), on other hardware.
* The restarted job finds the state in the checkpoint it loads and reruns the step (its first, checked
  although a run's first step is not otherwise). A rank whose check failed and that runs on the same
  node and device again: exit 16 again, nothing saved (restart once more, elsewhere). Otherwise each
  such rank compares the rejected values (each NaN/inf must come out the same; the other losses may
  differ in their last bits on other hardware): a different result means the first hardware computed a wrong one twice (a
  persistent fault: take it out of service); the same result means the result is the data's or the
  model's. Both are exit 17 as in Megatron-LM (a fatal result does not train on); the message says how
  to go on (skip the step with ``--iterations-to-skip``, which the tracker file does by itself on the
  next start, or resume once with ``--rerun-mode disabled``).

Without ``--save`` (or with ``--no-save-rng``) a reproduced NaN/inf stops the run as before (exit 1).
A resumed checkpoint's pending rerun is ignored with one line under ``--rerun-mode disabled`` and when
its iteration is skipped.
"""

from __future__ import annotations

import json
import math
import os
import weakref

import torch.distributed as dist

from ..checkpoint.format import iteration_dir
from ..console import print_rank_0
from ..errors import ConfigError
from ..files import replaced_whole
from ..parallel.random import set_rng_states
from .exit_signal import any_rank
from .rerun import (
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    ResultRejectedError,
    ResumeToDisambiguateError,
    _same,
    host_and_device,
    same_values,
)

STATE_FOLDER = "rerun_state"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def state_path(root: str, iteration: int, rank: int) -> str:
    return os.path.join(iteration_dir(root, iteration), STATE_FOLDER, f"rank_{rank:05d}.json")


def write_state(root: str, iteration: int, record: dict) -> None:
    """This rank's pending-rerun record into checkpoint ``iteration`` (whole: temporary name, then renamed)."""
    path = state_path(root, iteration, _rank())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with replaced_whole(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    if dist.is_initialized():
        dist.barrier()


def read_state(root: str, iteration: int) -> dict | None:
    """This rank's pending-rerun record of checkpoint ``iteration``, or None when it holds none."""
    folder = os.path.dirname(state_path(root, iteration, 0))
    if not os.path.isdir(folder):
        return None
    path = state_path(root, iteration, _rank())
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        keys = {"iteration", "failed", "values", "where", "what", "injected", "world_size"}
        if not isinstance(record, dict) or not keys <= set(record):
            raise ValueError("fields missing")
    except (OSError, ValueError) as err:
        raise ConfigError(f"--load {root}: the pending result-validation rerun of checkpoint {iteration} cannot be "
                          f"read from {path} ({err}); resume with the ranks that saved it, or pass --rerun-mode "
                          "disabled to train on without the rerun") from None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if record["world_size"] != world:
        raise ConfigError(f"--load {root}: checkpoint {iteration} holds a result-validation rerun saved by "
                          f"{record['world_size']} ranks, this run has {world}; resume with {record['world_size']} "
                          "ranks, or pass --rerun-mode disabled to train on without the rerun")
    return record


def _same_rejected(first: list[float], again: list[float]) -> bool:
    """Other hardware reproduced the result: each value that was NaN/inf is again, and the same (Megatron-LM
    compares the rejected result alone: the other losses may differ in their last bits on other hardware);
    with none, every value as the rerun on the same hardware compares them."""
    rejected = [i for i, v in enumerate(first) if not math.isfinite(v)]
    if not rejected:
        return same_values(first, again)
    return len(again) == len(first) and all(_same(first[i], again[i], 0.0) for i in rejected)


class SecondStage:
    """One run's part of the second stage: the exit-16 save (``can_save``) and, in a job restarted from
    such a checkpoint, the ``pending`` record whose step the validator reruns first."""

    def __init__(self, training, pending: dict | None):
        self.training = weakref.ref(training)  # not the loop itself: the validator must not keep it alive
        ck = training.config.checkpoint
        self.can_save = bool(ck.save) and not ck.no_save_rng
        self.pending = pending

    def save_and_exit(self, validator, failed: bool, values: list[float], what: str, injected) -> None:
        """Save the checkpoint before this step with this rank's record, then exit 16 on every rank."""
        training = self.training()
        set_rng_states(validator.saved_rng, validator.rng_tracker)  # the states the step started from
        training.save()  # kept when this iteration is saved already
        if training.async_saves is not None:
            training.async_saves.wait(final=True)
        root, iteration = training.config.checkpoint.save, training.iteration
        write_state(root, iteration, {
            "iteration": iteration, "failed": failed, "values": values, "where": list(host_and_device()),
            "what": what, "injected": injected, "world_size": dist.get_world_size() if dist.is_initialized() else 1})
        raise ResumeToDisambiguateError(
            f"iteration {iteration + 1}: the rerun of the step reproduced {what} on the same hardware: saved "
            f"checkpoint {iteration} in {root} with the step to rerun, exit code {EXIT_CODE_RESUME_TO_DISAMBIGUATE}; "
            f"restart the job from it (--load {root}) on other nodes or GPUs to tell a hardware fault from the "
            "data's result")

    def second_rerun(self, validator, values: list[float]) -> None:
        """The pending step, run again on this job's hardware: exit 16 (same hardware again) or 17."""
        p, self.pending = self.pending, None
        failed, where = p["failed"], tuple(p["where"])
        step = f"iteration {p['iteration'] + 1}"
        if any_rank([failed and where == host_and_device()])[0]:
            raise ResumeToDisambiguateError(
                f"{step}: restarted on the hardware that computed {p['what']} (node {where[0]}, {where[1]}); "
                f"nothing saved, exit code {EXIT_CODE_RESUME_TO_DISAMBIGUATE}: restart again from the same checkpoint "
                "on other nodes or GPUs")
        differs = failed and not _same_rejected(p["values"], values)
        if p["injected"] in ("persistent_error", "correct_result"):  # the injected verdict, as in Megatron-LM
            differs = failed and p["injected"] == "persistent_error"
        status = "second_rerun_" + ("not_" if differs else "") + "reproducible"
        validator.track(failed, [(status, values)], p["what"])
        if any_rank([differs])[0]:
            raise ResultRejectedError(
                f"{step}: the rerun on other hardware did not reproduce {p['what']}: the first hardware computed a "
                f"wrong result twice (a persistent fault: take it out of service), exit code 17; to go on, resume "
                "the same checkpoint once with --rerun-mode disabled")
        raise ResultRejectedError(
            f"{step}: the rerun on other hardware reproduced {p['what']}: the result is the data's or the model's, "
            f"not a hardware fault, exit code 17; to go on, resume with --iterations-to-skip {p['iteration']} "
            "(the --result-rejected-tracker-filename file skips it by itself on the next start)")


def attach_second_stage(training) -> None:
    """Give the run's validator its second stage; a loaded checkpoint's pending rerun is read here."""
    config, validator = training.config, training.validator
    ck = config.checkpoint
    pending = None
    if ck.load and not ck.finetune:
        pending = read_state(ck.load, training.iteration)
    if pending is not None and not validator.enabled:
        print_rank_0(f"> --load {ck.load}: the pending rerun of iteration {pending['iteration'] + 1} (exit 16) is "
                     "ignored: result validation is off (--rerun-mode disabled); training goes on from that checkpoint")
        pending = None
    if pending is not None and pending["iteration"] in validator.skips:
        print_rank_0(f"> --load {ck.load}: the pending rerun of iteration {pending['iteration'] + 1} (exit 16) is "
                     "dropped: that iteration is skipped")
        pending = None
    if pending is not None and ck.no_load_rng:
        raise ConfigError(f"--no-load-rng: checkpoint {training.iteration} in {ck.load} holds a result-validation rerun "
                          "(exit 16), which needs the step's saved random states; drop --no-load-rng, or pass "
                          "--rerun-mode disabled to train on without the rerun")
    if pending is not None:
        print_rank_0(f"> --load {ck.load}: rerunning iteration {pending['iteration'] + 1} on this hardware to tell a "
                     f"hardware fault from the data's result ({pending['what']} was reproduced on the first)")
    validator.stage2 = SecondStage(training, pending)
