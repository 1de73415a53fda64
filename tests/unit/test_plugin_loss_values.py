"""plugin_loss_values in one process (moe/metrics.py): what a --spec's modules log, per step, and
how often the names are exchanged (a two-rank world faked: every rank logs the same names)."""

import types

import torch

from megatron_lite.moe import metrics
from megatron_lite.parallel.state import ParallelState


def _fake_world(monkeypatch) -> list:
    calls = []

    def all_gather_object(every, names):
        calls.append(list(names))
        every[:] = [list(names)] * len(every)

    monkeypatch.setattr(metrics, "dist", types.SimpleNamespace(
        is_initialized=lambda: True, get_world_size=lambda: 2, all_gather_object=all_gather_object))
    return calls


def test_a_name_is_reported_on_the_steps_it_is_logged():
    module = torch.nn.Module()
    chunk, state = torch.nn.ModuleList([module]), ParallelState()
    reported = []
    for step in range(1, 5):
        module.aux_losses = {"a": torch.tensor(float(step))}
        if step in (2, 3):
            module.aux_losses["b"] = torch.tensor(1.0)
        reported.append(metrics.plugin_loss_values([chunk], state, 1))
    assert reported == [{"a": 1.0}, {"a": 2.0, "b": 1.0}, {"a": 3.0, "b": 1.0}, {"a": 4.0}]
    assert module.aux_losses == {}


def test_the_names_are_exchanged_once_not_on_every_step(monkeypatch):
    calls = _fake_world(monkeypatch)
    modules = [torch.nn.Module() for _ in range(2)]
    chunk, state = torch.nn.ModuleList(modules), ParallelState()
    for step in range(1, 6):
        modules[0].aux_losses = {"z": torch.tensor(2.0), "a": torch.tensor(float(step))}
        modules[1].aux_losses = {"a": torch.tensor(3.0)}
        assert metrics.plugin_loss_values([chunk], state, 2) == {"a": (step + 3.0) / 2 / 2, "z": 1.0}
    assert calls == [["a", "z"]]


def test_a_spec_that_logs_nothing_exchanges_nothing(monkeypatch):
    calls = _fake_world(monkeypatch)
    chunk, state = torch.nn.ModuleList([torch.nn.Linear(2, 2)]), ParallelState()
    assert [metrics.plugin_loss_values([chunk], state, 1) for _ in range(3)] == [{}] * 3
    assert calls == []
