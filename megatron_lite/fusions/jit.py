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

Where compiling is impossible the functions run eagerly and ONE line says so, once per process and
device: no working C++ compiler for Inductor's CPU backend (the compilers Inductor itself tries,
``torch._inductor.config.cpp.cxx``: ``$CXX``, default ``g++``, each asked for ``--version``; the
``aot_eager`` and ``eager`` backends need none), a Python Dynamo does not support, or a compile that
fails for want of a compiler at any call. Eager, not ``aot_eager``: for one small function that
backend would trace it and run the same unfused operations, so there is nothing to win. A function
Dynamo cannot compile for another reason runs eagerly alone, with one line naming it. Inside a region
that is itself being compiled (``--torch-compile``) the plain function is called, so Dynamo inlines it
into the region. (``--torch-compile`` itself is refused without a compiler,
:func:`megatron_lite.fusions.compile.check_compile_available`, from the same check.)
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import torch

from ..console import print_rank_0

JIT_FUSER_MODES = ("auto", "compile", "eager")
_settings = {"mode": "auto", "backend": "inductor"}


def set_jit_fuser(mode: str, backend: str = "inductor") -> None:
    """How ``jit_fuser`` functions run from now on (``auto``, ``compile`` or ``eager``), and the
    ``torch.compile`` backend they compile with."""
    if mode not in JIT_FUSER_MODES:
        raise ValueError(f"--jit-fuser {mode!r}: expected one of {', '.join(JIT_FUSER_MODES)}")
    _settings.update(mode=mode, backend=backend)
    _eager_devices.clear()  # a new configuration: looked at again (compile_unavailable is cached)


def jit_fuser_mode() -> str:
    return _settings["mode"]


_eager_devices: dict[tuple[str, str], str] = {}  # (device type, backend) -> why every jit_fuser function runs eagerly


def _inductor_cxx() -> list[str]:
    """The C++ compilers Inductor's CPU backend tries, in order (``$CXX`` when set at import, else g++)."""
    import torch._inductor.config as inductor_config

    search = inductor_config.cpp.cxx
    return [c for c in (search if isinstance(search, (list, tuple)) else (search,)) if c]


def _cxx_works(name: str) -> bool:
    path = shutil.which(name)
    if path is None:
        return False
    try:
        subprocess.run([path, "--version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


@functools.cache
def compile_unavailable(device_type: str, backend: str = "inductor") -> str | None:
    """Why ``torch.compile`` with ``backend`` cannot build kernels for ``device_type`` here (None when it
    can). Inductor on a CPU needs a working C++ compiler among those Inductor itself tries."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python/PyTorch build"
    if device_type == "cpu" and backend == "inductor":
        names = _inductor_cxx()
        if os.environ.get("TORCH_INDUCTOR_INSTALL_GXX") or any(_cxx_works(c) for c in names):
            return None
        return f"no working C++ compiler for Inductor's CPU backend (tried {', '.join(names) or 'none'})"
    return None


def _is_compiler_error(err: BaseException) -> bool:
    """Whether a failed compile failed for want of a (working) C++ compiler (InvalidCxxCompiler,
    CppCompileError, possibly wrapped by Dynamo / Inductor)."""
    while err is not None:
        if any(name in f"{type(err).__name__}: {err}" for name in ("InvalidCxxCompiler", "CppCompileError")):
            return True
        err = err.__cause__ or err.__context__
    return False


def fall_back_to_eager(device_type: str, reason: str) -> bool:
    """Every ``jit_fuser`` function runs eagerly on ``device_type`` from now on; prints one line the
    first time (rank 0). Returns whether this call was the first."""
    key = (device_type, _settings["backend"])
    if key in _eager_devices:
        return False
    _eager_devices[key] = reason
    fix = "install g++ or point CXX at a working C++ compiler to compile them, or " if "C++" in reason else ""
    print_rank_0(f"> jit_fuser: fused functions run eagerly on {device_type}: {reason}; {fix}pass --jit-fuser eager "
                 "to run them eagerly without this line")
    return True


def check_jit_fuser(device_type: str) -> str | None:
    """At start-up: whether the run's fused functions can compile on ``device_type`` as ``--jit-fuser``
    asks; where they cannot, they fall back to eager now, with the one line (returns the reason)."""
    mode = _settings["mode"]
    if mode == "eager" or (mode == "auto" and device_type == "cpu"):
        return None
    reason = compile_unavailable(device_type, _settings["backend"])
    if reason is not None:
        fall_back_to_eager(device_type, reason)
    return reason


class _FusedFunction:
    """A ``jit_fuser``-decorated function: eager or compiled, decided per call (module docstring)."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._compiled: dict[str, object] = {}  # backend -> torch.compile'd fn
        self._fallback: set[str] = set()  # device types where this function failed to compile: eager there

    def _wants_compile(self, args) -> str | None:
        """The device type to compile for, or None to run eagerly."""
        mode = _settings["mode"]
        if mode == "eager" or (mode == "auto" and args and isinstance(args[0], torch.Tensor) and args[0].is_cpu):
            return None  # (the CPU default first, decided without a generator or a device object: a call's cost)
        if torch.compiler.is_compiling():
            return None
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device = tensor.device.type if tensor is not None else "cpu"
        if mode == "auto" and device == "cpu":
            return None
        if device in self._fallback or (device, _settings["backend"]) in _eager_devices:
            return None
        reason = compile_unavailable(device, _settings["backend"])
        if reason is not None:
            fall_back_to_eager(device, reason)
            return None
        return device

    def compiles_for(self, *args) -> bool:
        """Whether a call with these arguments would run compiled: inside a region being compiled
        (Dynamo inlines it), or compiled by ``--jit-fuser`` (for a caller that has a better eager
        route of its own)."""
        return torch.compiler.is_compiling() or self._wants_compile(args) is not None

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
        except Exception as err:  # compiling failed: no compiler (any call), or this function (first call)
            why = f"{type(err).__name__}: {err}".splitlines()[0]
            if _is_compiler_error(err):
                fall_back_to_eager(device, f"compiling failed without a working C++ compiler ({why})")
            elif first:
                self._fallback.add(device)
                print_rank_0(f"> jit_fuser: {self.fn.__name__} runs eagerly on {device}: {why}")
            else:
                raise
            return self.fn(*args, **kwargs)


def jit_fuser(fn):
    """Decorator: ``fn`` runs eagerly or through ``torch.compile`` as :func:`set_jit_fuser` says."""
    return _FusedFunction(fn)
