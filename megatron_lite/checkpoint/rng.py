"""RNG states in checkpoints: every generator a rank draws from, saved and restored."""

from __future__ import annotations

import random

import numpy as np
import torch

from ..device import get_device


def get_rng_states(tracker) -> dict:
    """Every generator this rank draws from (``tracker``: the model-parallel RNG tracker), in types
    that ``weights_only`` loading accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch_cpu": torch.get_rng_state(),
        "tracker": tracker.get_states(),
        "cuda": None,
    }
    if get_device().type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(get_device())  # this rank's GPU only (GPU counts may change)
    return states


def set_rng_states(states: dict, tracker) -> None:
    """Restore what :func:`get_rng_states` returned, into these generators and ``tracker``."""
    random.setstate(states["python"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch_cpu"])
    tracker.set_states(states["tracker"])
    if states.get("cuda") is not None and get_device().type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], get_device())
