"""Model-parallel random number generation and activation checkpointing that restores it.

Two streams matter (Megatron's scheme):

* the *default* stream (``torch.manual_seed(seed + 100 * pp_rank)``) drives dropout outside
  tensor-parallel regions. It is identical on every tensor- and data-parallel rank, so replicated
  activations see identical masks;
* the *tensor-parallel* stream (seed ``seed + 2718 + tp_rank``) lives in :class:`RNGStatesTracker`
  and is forked around dropout inside TP regions (attention probabilities of a rank's heads), so
  each TP rank draws its own, reproducible masks.

The tracker belongs to the :class:`~megatron_lite.parallel.state.ParallelState`
(``state.rng_tracker``); :func:`model_parallel_seed` seeds it. Layers fork it through the state they
were built with, so several states (tests build many in one process) never share streams.

The tracker swaps generator states of the active device: the CPU generator on CPU runs, the
current CUDA generator on GPU runs.
"""

from __future__ import annotations

import contextlib

import torch

from ..device import get_device

TP_RNG = "model-parallel-rng"
EXPERT_RNG = "expert-parallel-rng"


def _get_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be forked into for a block of code."""

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}

    def reset(self):
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        device = get_device()
        saved = _get_rng_state(device)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_rng_state(device)
        _set_rng_state(saved, device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG):
        """Run the block with generator ``name``; its advanced state is kept for next time."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added; call model_parallel_seed() first")
        device = get_device()
        outer = _get_rng_state(device)
        _set_rng_state(self.states[name], device)
        try:
            yield
        finally:
            self.states[name] = _get_rng_state(device)
            _set_rng_state(outer, device)


def model_parallel_seed(seed: int, state) -> None:
    """Seed the default stream and the tracker for this rank (Megatron's offsets).

    default: ``seed + 100 * pp_rank`` (same on all TP and DP ranks of a stage);
    tensor-parallel: ``seed + 2718 + tp_rank``; expert-parallel: ``seed + 2718 + 1024 + 100 * ep_rank + etp_rank``
    (the expert-tensor rank: on a folded expert grid the ranks of one ETP group may share a TP rank).
    """
    default_seed = seed + 100 * state.pp_rank
    torch.manual_seed(default_seed)
    if get_device().type == "cuda":
        torch.cuda.manual_seed(default_seed)
    tracker = state.rng_tracker
    tracker.reset()
    tracker.add(TP_RNG, default_seed + 2718 + state.tp_rank)
    etp_rank = getattr(state, "etp_rank", state.tp_rank)
    tracker.add(EXPERT_RNG, default_seed + 2718 + 1024 + 100 * state.ep_rank + etp_rank)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing.


def rng_states(tracker: RNGStatesTracker):
    """Every generator state a step draws from (CPU, the accelerator's, the tracker's), to replay it."""
    return _capture(tracker)


def set_rng_states(saved, tracker: RNGStatesTracker) -> None:
    """Put back what :func:`rng_states` returned."""
    _restore(saved, tracker)


def _capture(tracker: RNGStatesTracker):
    device = get_device()
    return torch.get_rng_state(), (_get_rng_state(device) if device.type == "cuda" else None), tracker.get_states()


def _restore(saved, tracker: RNGStatesTracker):
    cpu, accel, states = saved
    torch.set_rng_state(cpu)
    if accel is not None:
        _set_rng_state(accel, get_device())
    tracker.set_states(states)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, tracker, *args):
        ctx.run, ctx.tracker = run, tracker
        ctx.rng = _capture(tracker)
        with torch.no_grad():
            outputs = run(*args)
        ctx.save_for_backward(*[a if torch.is_tensor(a) else None for a in args])
        ctx.non_tensor = [None if torch.is_tensor(a) else a for a in args]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        args = []
        for tensor, other in zip(saved, ctx.non_tensor):
            if tensor is None:
                args.append(other)
            else:
                detached = tensor.detach()
                detached.requires_grad_(tensor.requires_grad)
                args.append(detached)
        now = _capture(ctx.tracker)
        _restore(ctx.rng, ctx.tracker)  # replay the forward's random draws (dropout masks)
        try:
            with torch.enable_grad():
                outputs = ctx.run(*args)
        finally:
            _restore(now, ctx.tracker)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(a.grad if torch.is_tensor(a) else None for a in args)


def _with_grad_anchor(args: tuple) -> tuple:
    """``args`` with the first floating-point tensor made a fresh leaf requiring grad, when a graph
    is being built and no tensor argument requires grad: an autograd function's outputs require
    grad only through its inputs, so otherwise parameters inside ``run`` (e.g. LoRA adapters after
    frozen layers) would get no gradient."""
    if not torch.is_grad_enabled() or any(torch.is_tensor(a) and a.requires_grad for a in args):
        return args
    for i, a in enumerate(args):
        if torch.is_tensor(a) and a.is_floating_point():
            return args[:i] + (a.detach().requires_grad_(),) + args[i + 1:]
    return args


def checkpoint(run, *args, tracker: RNGStatesTracker):
    """Run ``run(*args)`` without keeping its activations; recompute them in backward.

    The CPU, CUDA and ``tracker`` RNG states of the forward are restored for the recomputation, so
    dropout masks are identical; the states after backward are what they were before it. Parameters
    inside ``run`` get their gradients even when no argument requires grad (:func:`_with_grad_anchor`).
    """
    return _Checkpoint.apply(run, tracker, *_with_grad_anchor(args))
