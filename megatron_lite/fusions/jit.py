"""``jit_fuser``: the decorator of the small elementwise functions Megatron fuses into one kernel.

Megatron wraps its fused helpers (bias + GeLU, bias + SwiGLU, bias + dropout + residual, the
cross-entropy's per-token pieces) in ``jit_fuser``, which is ``torch.compile`` on current PyTorch.
Here the decorated function stays a plain PyTorch function until it is called, and each call
decides how it runs, from the mode set by ``--jit-fuser`` (:func:`set_jit_fuser`):

* ``eager``: the function runs as written (the same operations, one kernel each);
* ``compile``: ``torch.compile`` (Inductor) turns it into one fused kernel per call shape;
* ``auto`` (the default): compile for tensors on a GPU, eager on a CPU. Compiling on a CPU costs
  tens of seconds per function the first time (Inductor writes and builds C++), which a short run
  never wins back; long CPU runs can ask for ``compile``.

Where compiling is impossible (no C++ compiler for the CPU backend, a Python Dynamo does not
support) the function runs eagerly and one warning says why. Inside a region that is itself being
compiled (``--torch-compile``) the plain function is called, so Dynamo inlines it into the region.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings

import torch

JIT_FUSER_MODES = ("auto", "compile", "eager")
_settings = {"mode": "auto", "backend": "inductor"}


def set_jit_fuser(mode: str, backend: str = "inductor") -> None:
    """How ``jit_fuser`` functions run from now on (``auto``, ``compile`` or ``eager``), and the
    ``torch.compile`` backend they compile with."""
    if mode not in JIT_FUSER_MODES:
        raise ValueError(f"--jit-fuser {mode!r}: expected one of {', '.join(JIT_FUSER_MODES)}")
    _settings.update(mode=mode, backend=backend)


def jit_fuser_mode() -> str:
    return _settings["mode"]


@functools.cache
def compile_unavailable(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device_type`` here (None when it can)."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python/PyTorch build"
    if device_type == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) for Inductor's CPU backend"
    return None


class _FusedFunction:
    """A ``jit_fuser``-decorated function: eager or compiled, decided per call (module docstring)."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._compiled: dict[str, object] = {}  # backend -> torch.compile'd fn
        self._fallback: set[str] = set()  # device types where compiling failed: eager from then on

    def _wants_compile(self, args) -> str | None:
        """The device type to compile for, or None to run eagerly."""
        mode = _settings["mode"]
        if mode == "eager" or torch.compiler.is_compiling():
            return None
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device = tensor.device.type if tensor is not None else "cpu"
        if mode == "auto" and device == "cpu":
            return None
        if device in self._fallback:
            return None
        reason = compile_unavailable(device)
        if reason is not None:
            self._give_up(device, reason)
            return None
        return device

    def compiles_for(self, *args) -> bool:
        """Whether a call with these arguments would run compiled (for a caller that has a better
        eager route of its own)."""
        return self._wants_compile(args) is not None

    def _give_up(self, device: str, reason: str) -> None:
        self._fallback.add(device)
        warnings.warn(f"jit_fuser: {self.fn.__name__} runs eagerly on {device}: {reason}", stacklevel=3)

    def __call__(self, *args, **kwargs):
        device = self._wants_compile(args)
        if device is None:
            return self.fn(*args, **kwargs)
        backend = _settings["backend"]
        first = backend not in self._compiled
        if first:
            self._compiled[backend] = torch.compile(self.fn, backend=backend)
        try:
            return self._compiled[backend](*args, **kwargs)
        except Exception as err:  # compiling failed at the first call: run eagerly from now on
            if not first:
                raise
            self._give_up(device, f"{type(err).__name__}: {err}".splitlines()[0])
            return self.fn(*args, **kwargs)


def jit_fuser(fn):
    """Decorator: ``fn`` runs eagerly or through ``torch.compile`` as :func:`set_jit_fuser` says."""
    return _FusedFunction(fn)
