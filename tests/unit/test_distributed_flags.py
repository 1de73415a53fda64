"""--distributed-backend, --distributed-timeout-minutes, --deterministic-mode: what each refuses (one
line, exit 2), that the backend and timeout reach init_process_group and every subgroup, and that
deterministic algorithms are on during a run and given back after it."""

import datetime

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megatron_lite import device
from megatron_lite.arguments import parse_args
from megatron_lite.parallel import state as state_module
from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64"]
TINY = BASE + ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
               "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2", "--eval-iters", "0"]


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setenv("MEGATRON_LITE_DEVICE", "cpu")


@pytest.fixture
def on_cuda(monkeypatch):
    """The checks as they run on a GPU machine (nothing here touches CUDA itself)."""
    monkeypatch.delenv("MEGATRON_LITE_DEVICE", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _refused(capsys, flags, words):
    parse_refused(capsys, BASE + flags, words)


def test_nccl_without_cuda_is_refused(capsys, on_cpu):
    _refused(capsys, ["--distributed-backend", "nccl"], "--distributed-backend nccl needs CUDA")
    parse_args(BASE + ["--distributed-backend", "gloo"])


def test_gloo_on_cuda_is_refused_and_nccl_accepted(capsys, on_cuda):
    _refused(capsys, ["--distributed-backend", "gloo"], "--distributed-backend gloo on CUDA is not supported")
    parse_args(BASE + ["--distributed-backend", "nccl"])


@pytest.mark.parametrize("minutes", ["0", "-5"])
def test_timeout_must_be_positive(capsys, on_cpu, minutes):
    _refused(capsys, [f"--distributed-timeout-minutes={minutes}"], "--distributed-timeout-minutes must be positive")


def test_deterministic_mode_on_cuda_needs_a_fixed_nccl_algorithm(capsys, monkeypatch, on_cuda):
    """Unset, or set to an algorithm outside Megatron-LM's list (NVLS, NCCL's own choice), is refused."""
    _refused(capsys, ["--deterministic-mode"], "--deterministic-mode on CUDA needs NCCL_ALGO set to one of")
    for algo in ("NVLS", "Auto", "ring"):
        monkeypatch.setenv("NCCL_ALGO", algo)
        _refused(capsys, ["--deterministic-mode"], f"got {algo}; e.g. NCCL_ALGO=Ring")
    for algo in ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS"):
        monkeypatch.setenv("NCCL_ALGO", algo)
        assert parse_args(BASE + ["--deterministic-mode"]).training.deterministic_mode


def test_backend_and_timeout_reach_the_default_group_and_the_subgroups(monkeypatch, on_cpu):
    made = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(device, "_OWNS_PROCESS_GROUP", False)
    monkeypatch.setattr(device, "_TIMEOUT", None)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: made.setdefault("default", kw))
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout=None: made.setdefault("sub", timeout))
    monkeypatch.setattr(state_module, "_GROUPS", {})
    device.init_distributed(3, "gloo")
    state_module._group_of([0, 1])
    assert made["default"]["backend"] == "gloo"
    assert made["default"]["timeout"] == made["sub"] == datetime.timedelta(minutes=3)


@pytest.mark.parametrize("flags, inside", [(["--deterministic-mode"], True), ([], False)])
def test_deterministic_algorithms_during_the_run_only(monkeypatch, on_cpu, flags, inside):
    seen = []
    real_forward_step = pretrain_gpt.forward_step

    def forward_step(data_iterator, model):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real_forward_step(data_iterator, model)

    monkeypatch.setattr(pretrain_gpt, "forward_step", forward_step)
    pretrain_gpt.main(TINY + flags)
    assert seen == [inside, inside]
    assert not torch.are_deterministic_algorithms_enabled()
