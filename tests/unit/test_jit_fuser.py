"""jit_fuser's modes, and what happens where it cannot compile: a CPU without a working C++ compiler
for Inductor (simulated: Inductor's compiler list pointed at a path that does not exist, while the
machine's g++ / c++ stay on PATH), a compile that fails for want of one at a later call, and the
start-up line of ``--torch-compile`` saying which pieces are compiled and which stay eager."""

import pytest
import torch

import megatron_lite.fusions.jit as jit
from megatron_lite.config import ConfigError
from megatron_lite.fusions import set_jit_fuser
from megatron_lite.fusions.compile import check_compile_available, configure_compilation
from megatron_lite.fusions.config import FusionConfig


@pytest.fixture()
def fresh_jit():
    """The jit_fuser settings and the cached compiler check, restored after the test."""
    jit.compile_unavailable.cache_clear()
    yield
    jit.compile_unavailable.cache_clear()
    set_jit_fuser("auto")


@pytest.fixture()
def no_cxx(monkeypatch, fresh_jit):
    """Inductor's CPU backend finds no working compiler: it tries only its cpp.cxx list ($CXX at import,
    default g++), here a path that does not exist."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/bin/g++"))
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)


def _fused_pair():
    @jit.jit_fuser
    def double(x):
        return 2 * x

    @jit.jit_fuser
    def halve(x):
        return x / 2

    return double, halve


def test_auto_runs_eagerly_on_cpu_and_modes_are_checked(fresh_jit):
    double, _ = _fused_pair()
    set_jit_fuser("auto")
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0)) and not double._compiled  # CPU: eager
    with pytest.raises(ValueError, match="--jit-fuser"):
        set_jit_fuser("sometimes")


def test_without_a_working_cxx_compiler_the_fused_functions_run_eagerly_after_one_line(no_cxx, capsys):
    """The old check accepted any of g++, c++, clang++ on PATH, which is not what Inductor tries: every
    fused function then compiled, failed in Inductor and warned on its own (two lines each, a failed
    compile each). The check now asks what Inductor asks; nothing is compiled and one line says why."""
    double, halve = _fused_pair()
    set_jit_fuser("compile")
    x = torch.arange(4.0, requires_grad=True)
    (double(x) + halve(x)).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.5))
    assert not double._compiled and not halve._compiled, "no compile attempted"
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    for word in ("jit_fuser", "eagerly on cpu", "no working C++ compiler", "/nonexistent/bin/g++", "CXX",
                 "--jit-fuser eager"):
        assert word in lines[0], lines[0]
    assert jit.compile_unavailable("cpu", "aot_eager") is None, "aot_eager generates no code: no compiler needed"


def test_torch_compile_is_refused_by_the_same_check(no_cxx):
    """--torch-compile with Inductor passed its start-up check (g++ on PATH) and died at the first step
    with Inductor's traceback; the same check as jit_fuser's refuses it, and aot_eager still passes."""
    with pytest.raises(ConfigError, match=r"--torch-compile \(backend inductor\) on cpu: no working C\+\+ compiler.*"
                                          r"/nonexistent/bin/g\+\+.*aot_eager"):
        check_compile_available(FusionConfig(torch_compile=True), "cpu")
    check_compile_available(FusionConfig(torch_compile=True, torch_compile_backend="aot_eager"), "cpu")


def test_a_compile_failing_for_want_of_a_compiler_at_a_later_call_falls_back(fresh_jit, monkeypatch, capsys):
    """A compile that works at first (a kernel from Inductor's disk cache, say) and fails for want of a
    compiler at a recompile (a new shape) raised out of the training step; it runs eagerly from then on,
    after one line. Another error at a later call is the function's own and is raised."""
    import torch._inductor.exc as inductor_exc

    calls = []

    def fake_compile(fn, backend, error):
        """torch.compile whose function works at the first call and raises ``error`` at the next."""
        def compiled(x):
            calls.append(x.shape)
            if len(calls) > 1:
                raise error
            return fn(x)
        return compiled

    error = RuntimeError("recompile")
    error.__cause__ = inductor_exc.InvalidCxxCompiler("/nonexistent/bin/g++")
    monkeypatch.setattr(jit, "compile_unavailable", lambda device, backend="inductor": None)
    monkeypatch.setattr(torch, "compile", lambda fn, backend: fake_compile(fn, backend, error))
    double, halve = _fused_pair()
    set_jit_fuser("compile")
    assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))  # the failing recompile: eager
    assert torch.equal(halve(torch.ones(3)), torch.full((3,), 0.5)) and not halve._compiled  # eager on cpu now
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "eagerly on cpu" in lines[0] and "C++ compiler" in lines[0], lines

    set_jit_fuser("compile")
    calls.clear()
    monkeypatch.setattr(torch, "compile", lambda fn, backend: fake_compile(fn, backend, ValueError("a bug of its own")))
    _, halve = _fused_pair()
    halve(torch.ones(2))
    with pytest.raises(ValueError, match="a bug of its own"):
        halve(torch.ones(3))


@pytest.mark.parametrize("mode, compiled, eager", [
    ("auto", ["the transformer layers", "the loss's fused pieces"], ["embedding"]),
    ("eager", ["the transformer layers"], ["the loss", "fused functions outside the layers", "--jit-fuser eager"]),
])
def test_torch_compile_says_what_is_compiled_and_what_stays_eager(fresh_jit, monkeypatch, capsys, mode, compiled,
                                                                   eager):
    """--torch-compile with --jit-fuser eager: the layers are compiled (the fused functions inside them
    are inlined into the layers' graphs) while the fused functions outside them, the loss's first, stay
    eager. One start-up line says so, rather than leaving the loss's speed a surprise."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fallback_random", inductor_config.fallback_random)
    configure_compilation(FusionConfig(torch_compile=True, torch_compile_backend="aot_eager", jit_fuser=mode), "cpu")
    assert jit.jit_fuser_mode() == ("compile" if mode == "auto" else "eager")
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("> --torch-compile (backend aot_eager)"), lines
    said_compiled, said_eager = lines[0].split("eager:", 1) if mode == "auto" else lines[0].split("; eager:", 1)
    for word in compiled:
        assert word in said_compiled, lines[0]
    for word in eager:
        assert word in said_eager, lines[0]

    double, _ = _fused_pair()
    torch._dynamo.reset()
    region = torch.compile(lambda x: double(x) + 1, backend="aot_eager")
    assert torch.equal(region(torch.ones(2)), torch.full((2,), 3.0))  # inside a compiled region: inlined
    assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
    assert bool(double._compiled) == (mode == "auto"), "outside the layers: as --jit-fuser says"
