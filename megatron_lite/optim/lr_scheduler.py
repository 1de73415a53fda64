"""Learning-rate schedule, stepped once per successful optimizer step.

With ``n`` the number of steps taken, ``W`` ``--lr-warmup-iters``, ``D`` ``--lr-decay-iters``
(default ``--train-iters``), peak ``lr`` and floor ``min_lr`` (Megatron's formulas):

* warmup (``W > 0`` and ``n <= W``): ``init + (lr - init) * n / W``, ``init`` being ``--lr-warmup-init``
  (default 0: from 0; the decoupled group warms up from it to ``--decoupled-lr`` the same way);
* ``constant``: ``lr`` after warmup;
* past the decay (``n > D``): ``min_lr``;
* ``linear``: ``min_lr + (lr - min_lr) * (1 - r)`` with ``r = (n - W) / (D - W)``;
* ``cosine``: ``min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * r))``;
* ``inverse-square-root``: ``max(min_lr, lr * sqrt(max(W, 1) / n))`` after warmup (``D`` not used);
* ``WSD`` (warmup-stable-decay): ``lr`` until ``D - Dw`` (``Dw`` = ``--lr-wsd-decay-iters``),
  then with ``q = (n - (D - Dw)) / Dw`` the factor ``1 - q`` (linear),
  ``0.5 * (1 + cos(pi * q))`` (cosine), ``2 * 0.5**q - 1`` (exponential) or ``1 - sqrt(q)``
  (minus_sqrt) between min_lr and lr.

With ``--train-samples`` the same formulas count samples: ``n`` grows by the global batch size per
step and ``W``, ``D``, ``Dw`` are ``--lr-warmup-samples``, ``--lr-decay-samples`` (default
``--train-samples``) and ``--lr-wsd-decay-samples``. ``--lr-warmup-fraction`` sets ``W`` to that
fraction of ``D`` in either mode.

The same scheduler sets the weight decay of the decaying parameter group
(:mod:`megatron_lite.optim.wd_schedule`: ``--weight-decay-incr-style``).
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from .wd_schedule import weight_decay_at, weight_decay_ends

# What a checkpoint's schedule is compared on when resuming: (attribute, the flag that sets it).
SCHEDULE_FLAGS = (
    ("max_lr", "--lr"), ("min_lr", "--min-lr"), ("warmup_init", "--lr-warmup-init"), ("style", "--lr-decay-style"), ("warmup_steps", "--lr-warmup-iters"),
    ("decay_steps", "--lr-decay-iters (default --train-iters)"), ("wsd_style", "--lr-wsd-decay-style"),
    ("wsd_decay_steps", "--lr-wsd-decay-iters"), ("decoupled_lr", "--decoupled-lr"),
    ("decoupled_min_lr", "--decoupled-min-lr"),
)
# The weight-decay schedule's, compared when either side schedules it (not constant).
WD_SCHEDULE_FLAGS = (("wd_incr_style", "--weight-decay-incr-style"), ("start_wd", "--start-weight-decay"),
                     ("end_wd", "--end-weight-decay"), ("wd_incr_steps", "--train-iters"))


class OptimizerParamScheduler:
    """Sets ``lr`` on every param group of ``optimizer`` from the step count, and ``weight_decay`` on
    the decaying groups (``optimizer.decay_groups``, one flag per group; without it, those whose
    decay is not 0 when the scheduler is made)."""

    def __init__(self, optimizer, config, train_iters: int, train_samples: int | None = None,
                 global_batch_size: int = 1):
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(config.lr), float(config.min_lr)
        self.style = config.lr_decay_style
        # With --train-samples the schedule counts samples: each step() advances it by a global batch.
        self.unit = "samples" if train_samples is not None else "iterations"
        self.step_size = int(global_batch_size) if train_samples is not None else 1
        unit, length = ("samples", train_samples) if train_samples is not None else ("iters", train_iters)
        decay = getattr(config, f"lr_decay_{unit}")
        self.decay_steps = int(decay if decay is not None else length)
        fraction = getattr(config, "lr_warmup_fraction", None)
        warmup = getattr(config, f"lr_warmup_{unit}")
        self.warmup_steps = fraction * self.decay_steps if fraction is not None else int(warmup)
        self.warmup_init = float(getattr(config, "lr_warmup_init", 0.0))
        self.wsd_style = config.lr_wsd_decay_style
        self.wsd_decay_steps = getattr(config, f"lr_wsd_decay_{unit}")
        if self.style not in ("constant", "linear", "cosine", "inverse-square-root", "WSD"):
            raise ValueError(f"--lr-decay-style {self.style!r}: expected constant, linear, cosine, inverse-square-root or WSD")
        if self.min_lr > self.max_lr:
            raise ValueError(f"--min-lr {self.min_lr} is larger than --lr {self.max_lr}")
        if self.style not in ("constant", "inverse-square-root") and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"--lr-decay-{unit} {self.decay_steps} must exceed --lr-warmup-{unit} {self.warmup_steps} "
                f"for --lr-decay-style {self.style}"
            )
        if self.style == "WSD":
            if self.wsd_decay_steps is None or not 0 < self.wsd_decay_steps <= self.decay_steps:
                raise ValueError(
                    f"--lr-decay-style WSD needs 0 < --lr-wsd-decay-{unit} <= --lr-decay-{unit} {self.decay_steps}, "
                    f"got {self.wsd_decay_steps}"
                )
            if self.wsd_style not in ("exponential", "linear", "cosine", "minus_sqrt"):
                raise ValueError(f"--lr-wsd-decay-style {self.wsd_style!r}: expected exponential, linear, cosine or minus_sqrt")
        self.decoupled_lr = getattr(config, "decoupled_lr", None)
        self.decoupled_min_lr = None if self.decoupled_lr is None else float(
            config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr)
        self.decoupled_groups = list(getattr(optimizer, "decoupled_groups", None) or [])
        self.start_wd, self.end_wd = weight_decay_ends(config) if hasattr(config, "weight_decay") else (0.0, 0.0)
        self.wd_incr_style = getattr(config, "weight_decay_incr_style", "constant")
        self.wd_incr_steps = int(length)
        flags = getattr(optimizer, "decay_groups", None)
        self.decay_groups = list(flags) if flags is not None else [g.get("weight_decay", 0.0) > 0
                                                                     for g in optimizer.param_groups]
        self.override = bool(getattr(config, "override_opt_param_scheduler", False))
        self.use_checkpoint = bool(getattr(config, "use_checkpoint_opt_param_scheduler", False))
        self.num_steps = 0
        self.step(0)

    def get_lr(self, decoupled: bool = False) -> float:
        """The learning rate now; ``decoupled``: of the embedding and output layer under --decoupled-lr
        (the same schedule between --decoupled-lr and --decoupled-min-lr, default --min-lr)."""
        max_lr, min_lr = (self.decoupled_lr, self.decoupled_min_lr) if decoupled else (self.max_lr, self.min_lr)
        n = self.num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.warmup_init + (max_lr - self.warmup_init) * n / self.warmup_steps
        if self.style == "constant":
            return max_lr
        if self.style == "inverse-square-root":  # from the peak at the end of warmup, as 1 / sqrt(steps)
            return max(min_lr, max_lr * math.sqrt(max(self.warmup_steps, 1) / max(n, 1)))
        if n > self.decay_steps:
            return min_lr
        if self.style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                q = (n - anneal_start) / self.wsd_decay_steps
                if self.wsd_style == "linear":
                    coeff = 1.0 - q
                elif self.wsd_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * q) + 1.0)
                elif self.wsd_style == "minus_sqrt":
                    coeff = 1.0 - math.sqrt(q)
                else:
                    coeff = 2.0 * 0.5**q - 1.0
        else:
            r = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
            coeff = 1.0 - r if self.style == "linear" else 0.5 * (math.cos(math.pi * r) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int = 1) -> float:
        """Advance ``increment`` optimizer steps (each a global batch of samples when the schedule
        counts samples) and write the new lr into every param group."""
        self.num_steps += increment * self.step_size
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.decoupled_lr is not None:
            decoupled_lr = self.get_lr(decoupled=True)
            for group, dec in zip(self.optimizer.param_groups, self.decoupled_groups):
                if dec:
                    group["lr"] = decoupled_lr
        wd = self.get_wd()
        for group, decays in zip(self.optimizer.param_groups, self.decay_groups):
            if decays:
                group["weight_decay"] = wd
        return lr

    def get_wd(self) -> float:
        """The decaying groups' weight decay now (:func:`~megatron_lite.optim.wd_schedule.weight_decay_at`)."""
        return weight_decay_at(self.num_steps, self.start_wd, self.end_wd, self.wd_incr_steps, self.wd_incr_style)

    def state_dict(self) -> dict:
        return {
            "num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr, "style": self.style,
            "warmup_steps": self.warmup_steps, "warmup_init": self.warmup_init, "decay_steps": self.decay_steps,
            "wsd_style": self.wsd_style, "wsd_decay_steps": self.wsd_decay_steps, "unit": self.unit,
            "start_wd": self.start_wd, "end_wd": self.end_wd, "wd_incr_steps": self.wd_incr_steps,
            "wd_incr_style": self.wd_incr_style, "decoupled_lr": self.decoupled_lr,
            "decoupled_min_lr": self.decoupled_min_lr,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore the step count and, as Megatron-LM does, the schedule: a schedule that differs from
        this run's flags (a larger --train-iters moves the decay end) raises ConfigError unless
        ``--override-opt_param-scheduler`` (keep this run's flags) or
        ``--use-checkpoint-opt_param-scheduler`` (continue the checkpoint's schedule) says which.
        A schedule counted in iterations does not continue in samples, or the other way round."""
        saved_unit = sd.get("unit", "iterations")
        if saved_unit != self.unit:
            raise ConfigError(
                f"the checkpoint's learning-rate schedule counts {saved_unit}, this run's {self.unit}: resume with "
                + ("--train-samples (and --lr-*-samples)" if saved_unit == "samples" else "--train-iters (and --lr-*-iters)"))
        if not self.override:
            compared = SCHEDULE_FLAGS
            if "constant" != sd.get("wd_incr_style", "constant") or self.wd_incr_style != "constant":
                compared = SCHEDULE_FLAGS + WD_SCHEDULE_FLAGS
            differ = [(attr, flag) for attr, flag in compared if attr in sd and sd[attr] != getattr(self, attr)]
            if differ and not self.use_checkpoint:
                attr, flag = differ[0]
                if self.unit == "samples":  # the same schedule, counted in samples
                    flag = flag.replace("-iters", "-samples")
                raise ConfigError(
                    f"the learning-rate or weight-decay schedule differs from the checkpoint's: {flag} {getattr(self, attr)} in this "
                    f"run, {sd[attr]} in the checkpoint; pass --override-opt_param-scheduler to use this run's flags "
                    "or --use-checkpoint-opt_param-scheduler to continue the checkpoint's schedule")
            if self.decoupled_lr is None and sd.get("decoupled_lr") is not None:  # no group to give it to
                raise ConfigError(
                    f"the checkpoint's schedule gives the embedding and output layer --decoupled-lr {sd['decoupled_lr']} "
                    f"(--decoupled-min-lr {sd.get('decoupled_min_lr')}), which this run's optimizer has no group for; "
                    "add those flags to continue it, or pass --override-opt_param-scheduler instead")
            for attr, _ in differ:
                setattr(self, attr, sd[attr])
        self.num_steps = int(sd["num_steps"])
        self.step(0)


def build_scheduler(config, optimizer) -> OptimizerParamScheduler:
    """The flags' schedule for the whole ``Config``: ``pretrain``'s default ``scheduler_provider``
    (a script passes its own to train with a schedule that is not a flag)."""
    t = config.training
    return OptimizerParamScheduler(optimizer, config.optim, t.train_iters, t.train_samples, t.global_batch_size)
