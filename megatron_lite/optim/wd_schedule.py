"""Weight-decay schedule (``--start-weight-decay``, ``--end-weight-decay``, ``--weight-decay-incr-style``).

As Megatron-LM's optimizer-parameter scheduler: with ``n`` the steps taken (samples with
``--train-samples``) and ``N`` the run's length (``--train-iters``, or ``--train-samples``), the
decay of the matrices' parameter group is

* ``constant`` (the default): ``--weight-decay`` throughout (start and end are not given);
* ``linear``: ``start + (end - start) * n / N``;
* ``cosine``: ``start + (end - start) * 0.5 * (1 + cos(pi * (1 - n / N)))``;

and ``end`` once ``n > N``. Biases, norms and other parameters outside the decay group keep 0.
The schedule lives in :class:`~megatron_lite.optim.lr_scheduler.OptimizerParamScheduler`, so it is
saved in and restored from checkpoints with the learning rate's.
"""

from __future__ import annotations

import math

from ..errors import ConfigError

WD_INCR_STYLES = ("constant", "linear", "cosine")


def check_weight_decay_schedule(o) -> None:
    """Megatron-LM's rules: constant takes only --weight-decay; linear and cosine need both ends, with
    0 <= start <= end."""
    style, start, end = o.weight_decay_incr_style, o.start_weight_decay, o.end_weight_decay
    if style not in WD_INCR_STYLES:
        raise ConfigError(f"--weight-decay-incr-style {style!r}: expected {', '.join(WD_INCR_STYLES)}")
    if style == "constant":
        if start is not None or end is not None:
            raise ConfigError("--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or "
                              "cosine; with constant decay use --weight-decay")
        return
    if start is None or end is None:
        raise ConfigError(f"--weight-decay-incr-style {style} needs both --start-weight-decay and --end-weight-decay")
    if not 0 <= start <= end:
        raise ConfigError(f"--weight-decay-incr-style {style} needs 0 <= --start-weight-decay <= --end-weight-decay, "
                          f"got {start} and {end}")


def weight_decay_ends(o) -> tuple[float, float]:
    """(start, end) of the schedule: both --weight-decay when constant."""
    if getattr(o, "weight_decay_incr_style", "constant") == "constant" or o.start_weight_decay is None:
        return float(o.weight_decay), float(o.weight_decay)
    return float(o.start_weight_decay), float(o.end_weight_decay)


def weight_decay_at(n: int, start: float, end: float, steps: int, style: str) -> float:
    """The decay after ``n`` of ``steps`` (module docstring)."""
    if n > steps or style == "constant":
        return end
    ratio = n / steps if steps > 0 else 1.0
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)
