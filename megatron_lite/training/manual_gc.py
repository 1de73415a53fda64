"""``--manual-gc``: Python's cyclic garbage collector off during training, run at chosen points.

Python's collector starts on its own when allocation counts cross thresholds, so on a multi-rank
run each rank pauses at a different moment and the others wait for it in the next collective.
With ``--manual-gc`` (Megatron-LM's flags and behaviour) the automatic collector is disabled for
the run and a full collection runs once at the start, every ``--manual-gc-interval`` iterations
(0, the default: never between steps), before each evaluation and, for the objects the evaluation
made (the youngest generation), after it; ``--no-manual-gc-eval`` skips the two around evaluation.
Reference counting frees most objects as usual; only cycles wait for a collection. The collector's
previous state is restored when the run returns (a notebook or test process keeps running).
"""

from __future__ import annotations

import contextlib
import gc


class ManualGC:
    """The run's garbage-collection points (every method is a no-op without ``--manual-gc``)."""

    def __init__(self, training):
        self.on, self.interval, self.around_eval = training.manual_gc, training.manual_gc_interval, training.manual_gc_eval
        self.was_enabled = gc.isenabled()
        if self.on:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.on and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self):
        collect = self.on and self.around_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)

    def close(self) -> None:
        if self.on and self.was_enabled:
            gc.enable()
