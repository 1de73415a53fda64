"""Checkpoints in one process: round trip, RNG continuation, the load flags, refusals with one clear
message, and crash safety (a failed save never becomes "latest")."""

import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.checkpoint import (
    CheckpointError,
    checkpoint_config,
    load_checkpoint,
    save_checkpoint,
)
from megatron_lite.config import Config
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear


class TinyMLP(nn.Module):
    def __init__(self, state, hidden=8, ffn=16):
        super().__init__()
        self.tracker = state.rng_tracker
        self.fc1 = ColumnParallelLinear(hidden, ffn, state.tp_group)
        self.fc2 = RowParallelLinear(ffn, hidden, state.tp_group)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        with self.tracker.fork():
            h = F.dropout(h, p=0.2)
        return F.dropout(self.fc2(h), p=0.2)


class StepCounter:
    """A scheduler stand-in: anything with state_dict / load_state_dict."""

    def __init__(self):
        self.num_steps = 0

    def step(self):
        self.num_steps += 1

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, sd):
        self.num_steps = sd["num_steps"]


def _setup(tmp_path, hidden=8, seed=1):
    cfg = Config()
    cfg.checkpoint.save = cfg.checkpoint.load = str(tmp_path / "ckpt")
    state = ParallelState()
    torch.manual_seed(seed)
    model = TinyMLP(state, hidden)
    model_parallel_seed(1234, state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return cfg, state, model, opt, StepCounter()


def _train(model, opt, sched, steps):
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _draws(state):
    with state.rng_tracker.fork():
        tracked = torch.rand(3)
    return random.random(), float(np.random.rand()), torch.rand(3), tracked


def test_round_trip_continues_exactly(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 2)
    save_checkpoint(2, [model], opt, sched, consumed_samples=8, config=cfg, state=state)
    assert open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read().strip() == "2"
    assert (tmp_path / "ckpt" / "iter_0000002" / "mp_rank_00_000" / "model_optim_rng.pt").is_file()
    assert (tmp_path / "ckpt" / "iter_0000002" / "rng" / "rank_00000.pt").is_file()
    draws_after_save = _draws(state)
    reference = _train(model, opt, sched, 3)

    # A fresh process-like start: other weights, other RNG states, empty optimizer.
    _, state2, model2, opt2, sched2 = _setup(tmp_path, seed=99)
    random.seed(5)
    np.random.seed(5)
    assert load_checkpoint([model2], opt2, sched2, cfg, state2) == (2, 8)
    assert sched2.num_steps == 2
    draws = _draws(state2)
    assert draws[:2] == draws_after_save[:2]
    assert torch.equal(draws[2], draws_after_save[2]) and torch.equal(draws[3], draws_after_save[3])
    # Rewind the RNG by loading again, then the continued trajectory must be bit-identical.
    load_checkpoint([model2], opt2, sched2, cfg, state2)
    _draws(state2)
    assert _train(model2, opt2, sched2, 3) == reference
    assert checkpoint_config(cfg.checkpoint.save)["hidden_size"] == cfg.model.hidden_size


def test_no_load_optim_no_load_rng_and_finetune(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 2)
    save_checkpoint(2, [model], opt, sched, 8, cfg, state)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}

    cfg.checkpoint.no_load_optim = True
    cfg.checkpoint.no_load_rng = True
    _, _, m2, o2, s2 = _setup(tmp_path, seed=7)
    torch.manual_seed(42)
    before = torch.get_rng_state()
    assert load_checkpoint([m2], o2, s2, cfg, state) == (2, 8)
    assert all(torch.equal(v, saved_weights[k]) for k, v in m2.state_dict().items())
    assert len(o2.state) == 0 and s2.num_steps == 0, "optimizer and scheduler untouched"
    assert torch.equal(torch.get_rng_state(), before), "RNG untouched"

    cfg.checkpoint.no_load_optim = cfg.checkpoint.no_load_rng = False
    cfg.checkpoint.finetune = True
    _, _, m3, o3, s3 = _setup(tmp_path, seed=8)
    reloads = []
    o3.reload_model_params = lambda: reloads.append(True)  # MegatronOptimizer's master-weight refresh
    assert load_checkpoint([m3], o3, s3, cfg, state) == (0, 0)
    assert all(torch.equal(v, saved_weights[k]) for k, v in m3.state_dict().items())
    assert len(o3.state) == 0 and s3.num_steps == 0
    assert reloads == [True], "fp32 masters must be refreshed from the loaded weights"


def test_no_checkpoint_starts_from_scratch(tmp_path, capsys):
    cfg, state, model, opt, sched = _setup(tmp_path)
    assert load_checkpoint([model], opt, sched, cfg, state) == (0, 0)
    assert "no checkpoint found" in capsys.readouterr().out
    cfg.checkpoint.load = None
    assert load_checkpoint([model], opt, sched, cfg, state) == (0, 0)


def test_shape_mismatch_is_refused_naming_the_parameter(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    save_checkpoint(1, [model], opt, sched, 4, cfg, state)
    other = TinyMLP(state, hidden=12)
    cfg.model.hidden_size = 12
    with pytest.raises(CheckpointError) as err:
        load_checkpoint([other], None, None, cfg, state)
    msg = str(err.value)
    assert "does not match the model" in msg and "model_optim_rng.pt" in msg
    assert "fc1.weight has shape (16, 8) in the checkpoint, (16, 12) in this model" in msg
    assert "--hidden-size 64 (this run 12)" in msg and "; load it with --hidden-size 64, or pass --use-checkpoint-args" in msg  # what the config said at save time


def test_renamed_parameter_is_refused(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    save_checkpoint(1, [model], opt, sched, 4, cfg, state)
    other = nn.Sequential()
    other.add_module("fc1", model.fc1)
    other.add_module("proj", model.fc2)
    with pytest.raises(CheckpointError, match=r"missing in checkpoint: proj.weight.*not in this model: fc2.weight"):
        load_checkpoint([other], None, None, cfg, state)


def test_the_count_of_differing_tensors_is_of_tensors(tmp_path):
    """A flag that adds two tensors (one per layer, as --softmax-type learnable's sinks): "2 tensor(s)
    differ" (it said "1 parameter(s)", the count of message lines, then named two)."""
    cfg, state, model, opt, sched = _setup(tmp_path)
    save_checkpoint(1, [model], opt, sched, 4, cfg, state)
    model.fc1.sink, model.fc2.sink = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    cfg.model.softmax_type = "learnable"
    with pytest.raises(CheckpointError, match=r"--softmax-type vanilla \(this run learnable\); 2 tensor\(s\) differ, "
                                              r"e.g. missing in checkpoint: fc1.sink, fc2.sink"):
        load_checkpoint([model], None, None, cfg, state)


# torch.save reports a full disk as a RuntimeError from its zip writer (seen on a full tmpfs): it was a
# traceback, not the one line an OSError gives
FAILURES = {"OSError": OSError("disk full"),
            "RuntimeError": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_crash_during_save_keeps_previous_latest(tmp_path, monkeypatch, failure):
    cfg, state, model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 1)
    save_checkpoint(1, [model], opt, sched, 4, cfg, state)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, sched, 1)

    real_save = torch.save

    def dying_save(obj, path, *a, **k):
        if "mp_rank_" in str(path):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04 half a file")  # something partial is on disk when we die
            raise FAILURES[failure]
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(CheckpointError, match="could not save checkpoint iteration 2 .*(disk full|unexpected pos.*is the disk "
                                              "full).*previous checkpoint stays"):
        save_checkpoint(2, [model], opt, sched, 8, cfg, state)
    monkeypatch.setattr(torch, "save", real_save)

    root = tmp_path / "ckpt"
    assert open(root / "latest_checkpointed_iteration.txt").read().strip() == "1"
    assert not (root / "iter_0000002").exists(), "nothing half-written under the real name"
    assert not (root / ".tmp_iter_0000002").exists(), "a failed save removes its temporary folder"
    _, _, m2, o2, s2 = _setup(tmp_path, seed=3)
    assert load_checkpoint([m2], o2, s2, cfg, state) == (1, 4)
    assert all(torch.equal(v, good[k]) for k, v in m2.state_dict().items())


def test_missing_and_corrupt_files_are_named(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    save_checkpoint(3, [model], opt, sched, 4, cfg, state)
    path = tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model_optim_rng.pt is unreadable .*corrupt"):
        load_checkpoint([model], opt, sched, cfg, state)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"iter_0000003/mp_rank_00_000/model_optim_rng.pt is missing"):
        load_checkpoint([model], opt, sched, cfg, state)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("banana\n")
    with pytest.raises(CheckpointError, match="should hold an iteration number"):
        load_checkpoint([model], opt, sched, cfg, state)
    assert issubclass(CheckpointError, ValueError)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_tracker_naming_a_missing_iteration_is_named(tmp_path, fmt):
    """A tracker naming an iteration whose folder is gone was reported as a missing model file of an
    interrupted save, or (--ckpt-format torch_dist) as a checkpoint 'in the torch format'; now the
    tracker, the missing folder and the newest checkpoint there are named."""
    cfg, state, model, opt, sched = _setup(tmp_path)
    save_checkpoint(3, [model], opt, sched, 4, cfg, state)
    cfg.checkpoint.ckpt_format = fmt  # the format the run loads with
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration.txt names iteration 7 but .*iter_0000007 "
                                              r"does not exist; write the iteration .* \(newest: iter_0000003\)"):
        load_checkpoint([model], opt, sched, cfg, state)
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000003")
    with pytest.raises(CheckpointError, match="there is no checkpoint in that folder"):
        load_checkpoint([model], opt, sched, cfg, state)


@pytest.mark.parametrize("leftover", [".metadata", "common.pt", "mp_rank_01_000/model_optim_rng.pt", "rng/rank_00007.pt"])
def test_a_save_replaces_what_an_earlier_save_left_in_its_folder(tmp_path, leftover):
    """A torch save at an iteration whose folder already exists (a rolled-back tracker, another format
    or layout saved there before) used to write its files among the old ones: a leftover torch_dist
    ``common.pt`` / ``.metadata`` then made the next --load read the *old* checkpoint (the folder
    counts as torch_dist), another layout's ``mp_rank_01_000`` was merged by the converter."""
    cfg, state, model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 1)
    stale = tmp_path / "ckpt" / "iter_0000002" / leftover
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier save's file")
    save_checkpoint(2, [model], opt, sched, 8, cfg, state)
    folder = tmp_path / "ckpt" / "iter_0000002"
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "mp_rank_00_000/model_optim_rng.pt", "rng/rank_00000.pt"]
    assert not (tmp_path / "ckpt" / ".tmp_iter_0000002").exists()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _, _, m2, o2, s2 = _setup(tmp_path, seed=3)
    assert load_checkpoint([m2], o2, s2, cfg, state) == (2, 8)
    assert all(torch.equal(v, saved[k]) for k, v in m2.state_dict().items())
