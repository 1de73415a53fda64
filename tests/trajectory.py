"""Training trajectories, and the one comparison every parallel-vs-single-process test uses.

A :class:`Trajectory` is what a run reports per step: the loss, every reported loss by name (``lm
loss``, ``sop loss``, ``mtp_1 loss``, ...) and the gradient norm. :func:`assert_same_trajectory`
compares two of them step by step - losses *and* gradient norms, with one relative tolerance - and
fails when either is shorter than expected. Gradient norms catch what losses hide: with Adam and
gradient clipping a constant factor on every gradient barely moves the update, so a 2x gradient
bug shows in the loss only steps later, but in the gradient norm at step 1.

Inside a rank of :func:`tests.harness.run_ranks`, :func:`run_script` trains through a script's
``main(argv)`` and returns its (picklable) trajectory; :func:`ranks_trajectory` runs that on every
rank and returns the one trajectory the last-stage ranks agree on (:func:`ranks_trajectories`:
several runs in one pool call).

:func:`assert_same_weights` compares what the trajectory cannot see: the final weights of two save
folders, merged into the one-process layout, tensor by tensor.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field

from tests.harness import run_ranks


@dataclass(frozen=True)
class Trajectory:
    losses: list[float]
    grad_norms: list[float | None]
    reported: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def of(cls, result) -> Trajectory:
        """The trajectory of a :class:`~megatron_lite.training.loop.TrainResult`."""
        norms = [None if g is None else float(g) for g in result.grad_norms]
        return cls(list(result.losses), norms, [dict(r) for r in result.reported])

    def __len__(self) -> int:
        return len(self.grad_norms)

    def __add__(self, other: Trajectory) -> Trajectory:
        """The steps of ``self`` then those of ``other`` (a run stopped, then resumed)."""
        return Trajectory(self.losses + other.losses, self.grad_norms + other.grad_norms,
                          self.reported + other.reported)

    def __getitem__(self, steps: slice) -> Trajectory:
        """The steps ``steps`` (a slice) of a last-stage trajectory: ``whole[:4]``, ``whole[4:]``."""
        if not isinstance(steps, slice):
            raise TypeError("index a Trajectory with a slice of steps")
        return Trajectory(self.losses[steps], self.grad_norms[steps], self.reported[steps])


def run_script(script: str, argv: list[str]) -> Trajectory:
    """Inside a rank (or in this process): ``<script>.main(argv)``'s trajectory (``script`` is a
    module name such as ``"pretrain_gpt"``; losses are empty on ranks that are not a last stage)."""
    return Trajectory.of(importlib.import_module(script).main(argv))


def run_scripts(script: str, argvs: list[list[str]]) -> list[Trajectory]:
    """Inside a rank: :func:`run_script` for each of ``argvs`` in turn (several runs, one pool call)."""
    return [run_script(script, argv) for argv in argvs]


def ranks_trajectory(world: int, script: str, argv: list[str]) -> Trajectory:
    """Train on ``world`` ranks; the trajectory of the last-stage ranks, which must all agree
    (losses are averaged over data parallelism, gradient norms are global)."""
    return _agreed(run_ranks(world, run_script, script, argv))


def ranks_trajectories(world: int, script: str, argvs: list[list[str]]) -> list[Trajectory]:
    """:func:`ranks_trajectory` of each of ``argvs``, all run in one call to the ``world``-rank pool."""
    per_rank = run_ranks(world, run_scripts, script, argvs)
    return [_agreed([runs[i] for runs in per_rank]) for i in range(len(argvs))]


def _agreed(results: list[Trajectory]) -> Trajectory:
    """The one trajectory of the last-stage ranks (checked to agree) among every rank's."""
    last = [r for r in results if r.losses]
    assert last, "no rank reported losses"
    for other in last[1:]:
        assert other == last[0], "last-stage ranks disagree"
    for other in results:  # the gradient norm is global: every rank, first stages included, has the same
        assert other.grad_norms == last[0].grad_norms, "ranks disagree on the gradient norm"
    return last[0]


def run_trajectory(world: int, script: str, argv: list[str]) -> Trajectory:
    """:func:`run_script` in this process when ``world`` is 1, else :func:`ranks_trajectory`."""
    return run_script(script, argv) if world == 1 else ranks_trajectory(world, script, argv)


def _close(a, e, rtol: float) -> bool:
    if a is None or e is None:
        return a is None and e is None
    if not (math.isfinite(a) and math.isfinite(e)):
        return a == e or (math.isnan(a) and math.isnan(e))
    return abs(a - e) <= rtol * abs(e)


def assert_same_trajectory(actual: Trajectory, expected: Trajectory, *, rtol: float = 1e-5,
                           steps: int | None = None, grad_rtol: float | None = None, what: str = "") -> None:
    """Every step's loss (and every reported loss) and gradient norm of ``actual`` within ``rtol``
    (relative) of ``expected``'s. ``steps``: how many steps both must have (default: as many as
    ``expected``); ``grad_rtol``: the gradient norms' tolerance when it must differ from the loss's."""
    steps = len(expected) if steps is None else steps
    label = f"{what}: " if what else ""
    assert len(expected) == steps, f"{label}the reference ran {len(expected)} steps, expected {steps}"
    assert len(actual) == steps, f"{label}ran {len(actual)} steps, the reference {steps}"
    assert len(actual.losses) == len(expected.losses), f"{label}{len(actual.losses)} losses vs {len(expected.losses)}"
    grad_rtol = rtol if grad_rtol is None else grad_rtol
    for step, (a, e) in enumerate(zip(actual.grad_norms, expected.grad_norms, strict=True), 1):
        assert _close(a, e, grad_rtol), f"{label}step {step}: grad norm {a} vs single-process {e}"
    for step, (a, e) in enumerate(zip(actual.losses, expected.losses, strict=True), 1):
        assert _close(a, e, rtol), f"{label}step {step}: loss {a} vs single-process {e}"
    if actual.reported and expected.reported:
        for step, (a, e) in enumerate(zip(actual.reported, expected.reported, strict=True), 1):
            assert a.keys() == e.keys(), f"{label}step {step}: reported {sorted(a)} vs {sorted(e)}"
            for key in e:
                assert _close(a[key], e[key], rtol), f"{label}step {step}: {key} {a[key]} vs single-process {e[key]}"


def weight_errors(actual: dict, expected: dict, *, rtol: float, atol: float) -> list[tuple[float, str, float]]:
    """Per tensor, worst first: (largest excess of ``|a - e|`` over ``atol + rtol * |e|``, name, its
    relative error ``max |a - e| / max |e|``). An excess above 0 is a failure."""
    assert actual.keys() == expected.keys(), f"tensors differ: {sorted(actual.keys() ^ expected.keys())[:5]}"
    out = []
    for name, e in expected.items():
        a, e = actual[name].double(), e.double()
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(e.shape)}"
        diff = (a - e).abs()
        scale = e.abs().max().item() if e.numel() else 0.0
        excess = (diff - atol - rtol * e.abs()).max().item() if e.numel() else -1.0
        out.append((excess, name, diff.max().item() / scale if scale else float(diff.max().item() if e.numel() else 0)))
    return sorted(out, reverse=True)


def assert_same_weights(dir_a: str, dir_b: str, *, rtol: float = 1e-5, atol: float = 2e-6, what: str = "") -> None:
    """The final weights of two save folders (any TP/PP/EP/CP layout, merged into the one-process
    layout by :func:`~megatron_lite.checkpoint.merge.merge_checkpoint`) equal tensor by tensor within
    ``atol + rtol * |expected|`` per element; a failure names the worst tensor and its relative error.
    The trajectory's losses and global gradient norm can hide a wrong gradient on a small path; Adam
    turns it into an update of ~lr per element of that tensor, which this sees."""
    from megatron_lite.checkpoint import merge_checkpoint

    actual, expected = merge_checkpoint(dir_a)[0], merge_checkpoint(dir_b)[0]
    errors = weight_errors(actual, expected, rtol=rtol, atol=atol)
    bad = [e for e in errors if e[0] > 0]
    label = f"{what}: " if what else ""
    if bad:
        excess, name, rel = bad[0]
        raise AssertionError(f"{label}{len(bad)} of {len(errors)} tensors differ from the single-process weights; "
                             f"worst {name}: relative error {rel:.3g}, exceeds atol {atol} + rtol {rtol} by {excess:.3g}")
