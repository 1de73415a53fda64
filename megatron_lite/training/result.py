"""What :func:`~megatron_lite.training.loop.pretrain` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..parallel.state import ParallelState


@dataclass
class TrainResult:
    """What ``pretrain`` returns: handy for tests and notebooks (losses only on the last stage)."""

    iteration: int = 0
    consumed_samples: int = 0
    losses: list[float] = field(default_factory=list)
    reported: list[dict[str, float]] = field(default_factory=list)  # every reported loss per step (e.g. lm + sop)
    grad_norms: list[float | None] = field(default_factory=list)
    skipped_iterations: int = 0
    validation: list[tuple[int, float]] = field(default_factory=list)
    evaluations: list[tuple[int, str, dict]] = field(default_factory=list)  # every pass: (iteration, "validation"
    # / "validation NAME" (--multiple-validation-sets) / "test", its losses), the final passes included
    exit_reason: str = "done"
    chunks: list = field(default_factory=list, repr=False)  # the trained model chunks (DDP-wrapped)
    comm_volume: list = field(default_factory=list, repr=False)  # --log-comm-volume: per step {(kind, op): bytes sent}
    memory: list = field(default_factory=list, repr=False)  # --memory-report: this rank's MemoryReport.steps_seen
    stats: list = field(default_factory=list, repr=False)  # per step: the {params_norm, num_zeros} logged
    state: ParallelState | None = field(default=None, repr=False)
    optimizer: object = field(default=None, repr=False)
