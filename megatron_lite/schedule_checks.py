"""Checks of the training length, the learning-rate schedule and the optimizer's values (part of
:func:`megatron_lite.config_checks.finalize`): one :class:`~megatron_lite.errors.ConfigError` line each,
naming the flag; :func:`check_train_length` and :func:`check_schedule` also fill in --train-iters (from
--train-samples, or the default) and the decay length's default."""

from __future__ import annotations

from .config import DEFAULT_TRAIN_ITERS, Config
from .errors import ConfigError
from .optim.param_groups import check_decoupled_lr
from .optim.wd_schedule import check_weight_decay_schedule


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_schedule(config: Config) -> None:
    """Logging/evaluation intervals and the learning-rate schedule."""
    t, o = config.training, config.optim
    for name in ("log_interval", "eval_interval"):
        value = getattr(config.logging if name == "log_interval" else t, name)
        _require(value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
    check_train_iters(config)
    for flag, value, low in (("--eval-iters", t.eval_iters, 0),
                             ("--seed", t.seed, 0), ("--lr-warmup-iters", o.lr_warmup_iters, 0),
                             ("--lr", o.lr, 0), ("--min-lr", o.min_lr, 0), ("--lr-warmup-init", o.lr_warmup_init, 0)):
        _require(value >= low, f"{flag} must be at least {low}, got {value}")
    _require(o.min_lr <= o.lr, f"--min-lr {o.min_lr} is larger than --lr {o.lr}")
    _check_optimizer_values(o)
    _require(not (o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler),
             "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other; pick one")
    _check_lr_span(config)


def check_train_iters(config: Config) -> None:
    """A run trains at least one iteration: the command line's check, and pretrain()'s for a Config
    made or changed in code. Megatron-LM's --train-iters 0 is an evaluation-only run (no step, no
    save); here that is --skip-train, so 0 is refused rather than a run that does nothing and exits 0,
    or (as pretrain() did) saves the untrained weights as iteration 0."""
    t = config.training
    hint = (" (Megatron-LM's --train-iters 0 evaluation-only run is --skip-train here, with --load; "
            "tools/evaluate.py evaluates a checkpoint too)") if t.train_iters == 0 else ""
    _require(t.train_iters is not None and t.train_iters >= 1, f"--train-iters must be at least 1, got {t.train_iters}{hint}")


def check_train_length(config: Config) -> None:
    """--train-iters or --train-samples (Megatron's rules: one of them; with --train-samples the
    iterations are train-samples // global-batch-size and the learning-rate schedule counts samples,
    so its flags are the --lr-*-samples ones, and with --train-iters the --lr-*-iters ones)."""
    t, o = config.training, config.optim
    fraction = o.lr_warmup_fraction
    _require(fraction is None or 0 <= fraction < 1, f"--lr-warmup-fraction must be in [0, 1), got {fraction}")
    if t.train_samples is None:
        if t.train_iters is None:
            t.train_iters = DEFAULT_TRAIN_ITERS
        for flag, value, twin in (("--lr-decay-samples", o.lr_decay_samples, "--lr-decay-iters"),
                                  ("--lr-warmup-samples", o.lr_warmup_samples or None, "--lr-warmup-iters"),
                                  ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples, "--lr-wsd-decay-iters")):
            _require(value is None, f"{flag} needs --train-samples; this run counts iterations (--train-iters): "
                     f"use {twin}")
        _require(fraction is None or o.lr_warmup_iters == 0,
                 "--lr-warmup-fraction and --lr-warmup-iters exclude each other; give one")
        return
    _require(t.train_iters is None, "--train-iters and --train-samples exclude each other; give one")
    gbs = t.global_batch_size
    _require(t.train_samples >= gbs, f"--train-samples {t.train_samples} is less than one global batch "
             f"(--global-batch-size {gbs}); give at least {gbs}")
    t.train_iters = t.train_samples // gbs
    for flag, value, twin in (("--lr-decay-iters", o.lr_decay_iters, "--lr-decay-samples"),
                              ("--lr-warmup-iters", o.lr_warmup_iters or None, "--lr-warmup-samples"),
                              ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters, "--lr-wsd-decay-samples")):
        _require(value is None, f"{flag} counts iterations; with --train-samples the schedule counts samples: "
                 f"use {twin}")
    _require(o.lr_warmup_samples >= 0, f"--lr-warmup-samples must be at least 0, got {o.lr_warmup_samples}")
    _require(fraction is None or o.lr_warmup_samples == 0,
             "--lr-warmup-fraction and --lr-warmup-samples exclude each other; give one")


def _check_lr_span(config: Config) -> None:
    """Warmup, decay and WSD decay lengths, in iterations or (with --train-samples) samples; fills in
    the decay's default (--train-iters or --train-samples)."""
    t, o = config.training, config.optim
    unit, length = ("samples", t.train_samples) if t.train_samples is not None else ("iters", t.train_iters)
    decay_attr = f"lr_decay_{unit}"
    if getattr(o, decay_attr) is None:
        setattr(o, decay_attr, length)
    decay, wsd = getattr(o, decay_attr), getattr(o, f"lr_wsd_decay_{unit}")
    warmup_flag, warmup = f"--lr-warmup-{unit}", getattr(o, f"lr_warmup_{unit}")
    if o.lr_warmup_fraction is not None:
        warmup_flag, warmup = "--lr-warmup-fraction x --lr-decay-" + unit, o.lr_warmup_fraction * decay
    _require(o.lr_warmup_init == 0 or warmup > 0, f"--lr-warmup-init {o.lr_warmup_init} is where the warmup starts "
             f"and this run has none: add --lr-warmup-{unit} (or --lr-warmup-fraction), or drop --lr-warmup-init")
    _require(o.lr_decay_style in ("constant", "inverse-square-root") or decay > warmup,
             f"--lr-decay-{unit} {decay} (default --train-{unit}) must exceed {warmup_flag} "
             f"{warmup} for --lr-decay-style {o.lr_decay_style}")
    if o.lr_decay_style == "WSD":
        what = "steps" if unit == "iters" else "samples"
        _require(wsd is not None, f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (the {what} of the final decay)")
        _require(0 < wsd <= decay, f"--lr-decay-style WSD needs 0 < --lr-wsd-decay-{unit} <= --lr-decay-{unit} "
                 f"{decay} (default --train-{unit}), got {wsd}")


def _check_optimizer_values(o) -> None:
    """The optimizer's hyper-parameters, refused here rather than by torch's traceback (or, for a
    negative --weight-decay or --clip-grad, not at all: torch checks only its default, not a param
    group's, and the clipping step treated every --clip-grad <= 0 as "off")."""
    _require(o.weight_decay >= 0, f"--weight-decay must be at least 0, got {o.weight_decay}")
    _require(o.clip_grad >= 0, f"--clip-grad must be at least 0 (0 disables clipping), got {o.clip_grad}")
    check_weight_decay_schedule(o)
    check_decoupled_lr(o)
    if o.optimizer == "adam":
        for flag, beta in (("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2)):
            _require(0 <= beta < 1, f"{flag} must be in [0, 1), got {beta}")
        _require(o.adam_eps > 0, f"--adam-eps must be positive (with 0 an element whose gradient is 0 is "
                 f"updated by 0 / 0 = NaN), got {o.adam_eps}")


def check_sgd_momentum(config: Config) -> None:
    """--sgd-momentum: a negative one is torch's traceback; one of 1 or more never lets a gradient decay
    from the momentum buffer, which then grows with every step (torch accepts it)."""
    o = config.optim
    _require(o.optimizer != "sgd" or o.sgd_momentum >= 0, f"--sgd-momentum must be at least 0, got {o.sgd_momentum}")
    _require(o.optimizer != "sgd" or o.sgd_momentum < 1, f"--sgd-momentum must be less than 1 (each step keeps that "
             f"fraction of the momentum buffer: 1 or more never lets a gradient decay), got {o.sgd_momentum}")
