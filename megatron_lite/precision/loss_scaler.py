"""Loss scaling for fp16 training.

fp16 has a narrow exponent range, so small gradients underflow to zero. The loss is multiplied by
a scale before backward and the gradients are divided by it before the optimizer step. The
dynamic scaler follows Megatron-LM's rule: start at ``--initial-loss-scale`` (2^32); a
step whose gradients contain inf/NaN is skipped; after ``--hysteresis`` overflowing steps (not
necessarily consecutive) the scale halves, never below ``--min-loss-scale``; after
``--loss-scale-window`` clean steps in a row it doubles and the hysteresis budget is refilled.
A static ``--loss-scale`` also applies to bf16, as in Megatron-LM.
"""

from __future__ import annotations


class ConstantLossScaler:
    """A fixed scale (``--loss-scale``): overflowing steps are still skipped, the scale never moves."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"--loss-scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, sd: dict) -> None:
        """Nothing to restore: the scale is this run's ``--loss-scale`` (as in Megatron-LM), whatever
        the checkpoint's scaler was."""


class DynamicLossScaler:
    """Grow the scale while gradients stay finite, shrink it when they overflow."""

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError("--initial-loss-scale and --min-loss-scale must be positive")
        if min_scale > initial_scale:
            raise ValueError(f"--min-loss-scale {min_scale} is larger than --initial-loss-scale {initial_scale}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("--loss-scale-window and --hysteresis must be at least 1")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0  # clean steps since the last overflow or growth
        self.hysteresis_tracker = hysteresis  # overflows left before the scale shrinks

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome (call once per step, after the overflow check)."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, sd: dict) -> None:
        """Continue the checkpoint's scale; one saved by a static ``--loss-scale`` run has no trackers,
        so the dynamic scaling starts from its scale with a fresh window and hysteresis."""
        self.scale = float(sd["scale"])
        self.growth_tracker = int(sd.get("growth_tracker", 0))
        self.hysteresis_tracker = int(sd.get("hysteresis_tracker", self.hysteresis))


def build_loss_scaler(precision_config):
    """The scaler for ``--fp16`` (static with ``--loss-scale``, else dynamic) and, as in Megatron-LM,
    for ``--bf16`` with ``--loss-scale`` (static); None otherwise."""
    pc = precision_config
    if pc.loss_scale is not None and (pc.fp16 or pc.bf16):
        return ConstantLossScaler(pc.loss_scale)
    if not pc.fp16:
        return None
    return DynamicLossScaler(
        initial_scale=pc.initial_loss_scale,
        min_scale=pc.min_loss_scale,
        growth_interval=pc.loss_scale_window,
        hysteresis=pc.hysteresis,
    )
