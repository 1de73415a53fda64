"""A save repeating the iteration the tracker names (``--load`` then an immediate save, a rerun ending
at the same ``--exit-interval``) replaces ``iter_N`` in place: a crash at any filesystem step of that
swap must leave a loadable checkpoint (the old or the new one), never a tracker naming nothing."""

import os
import shutil

import pytest
import torch

from megatron_lite.checkpoint import CheckpointError, dist_save, load_checkpoint, save_checkpoint
from megatron_lite.checkpoint import training as ckpt
from tests.unit.test_checkpointing import _setup, _train


class Crash(BaseException):
    """The process dies here: no except-OSError cleanup runs."""


def _crash_at(monkeypatch, at: int) -> list:
    """Make finalize_save die at its ``at``-th rename / replace / remove (a tree removal deletes one
    file first: half a folder is gone when the process dies). Returns the operations seen."""
    seen, real_finalize = [], dist_save.finalize_save
    real = {"rename": os.rename, "replace": os.replace, "remove": os.remove, "rmtree": shutil.rmtree}

    def op(name):
        def run(path, *args, **kwargs):
            seen.append(name)
            if len(seen) - 1 == at:
                files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if name == "rmtree" else []
                if files:
                    real["remove"](files[0])
                raise Crash(f"{name} {path}")
            return real[name](path, *args, **kwargs)
        return run

    def finalize(root, iteration):
        with monkeypatch.context() as m:
            m.setattr(os, "rename", op("rename"))
            m.setattr(os, "replace", op("replace"))
            m.setattr(os, "remove", op("remove"))
            m.setattr(shutil, "rmtree", op("rmtree"))
            real_finalize(root, iteration)

    monkeypatch.setattr(dist_save, "finalize_save", finalize)
    monkeypatch.setattr(ckpt, "finalize_save", finalize)
    return seen


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, weights):
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def _loaded(tmp_path, cfg, state):
    _, _, model, opt, sched = _setup(tmp_path, seed=7)
    opt = opt if cfg.checkpoint.ckpt_format == "torch" else None  # torch_dist saves the project's optimizers only
    assert load_checkpoint([model], opt, sched, cfg, state)[0] == 1
    return model


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_crash_at_each_step_of_replacing_the_latest_folder(tmp_path, monkeypatch, fmt):
    at = 0
    while True:
        root = tmp_path / f"crash_{at}"
        cfg, state, model, opt, sched = _setup(root)
        cfg.checkpoint.ckpt_format = fmt
        saved_opt = opt if fmt == "torch" else None
        _train(model, opt, sched, 1)
        save_checkpoint(1, [model], saved_opt, sched, 4, cfg, state)
        old = _weights(model)
        _train(model, opt, sched, 1)
        new = _weights(model)
        with monkeypatch.context() as m:
            seen = _crash_at(m, at)
            try:
                save_checkpoint(1, [model], saved_opt, sched, 8, cfg, state)  # the same iteration again
                finished = True
            except Crash:
                finished = False
        loaded = _loaded(root, cfg, state)  # the tracker still names a complete checkpoint
        assert _same(loaded, old) or _same(loaded, new), f"crash at {seen[-1]}"
        if finished:
            assert _same(loaded, new)
            break
        _train(model, opt, sched, 1)  # the next save at that iteration cleans up and replaces it
        latest = _weights(model)
        save_checkpoint(1, [model], saved_opt, sched, 12, cfg, state)
        assert _same(_loaded(root, cfg, state), latest)
        assert sorted(os.listdir(root / "ckpt")) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        at += 1
    assert at >= 3, seen  # old folder aside, new one in, old one removed, tracker


def test_aside_folder_that_cannot_be_renamed_back_is_explained(tmp_path, monkeypatch):
    cfg, state, model, opt, sched = _setup(tmp_path)
    save_checkpoint(1, [model], opt, sched, 4, cfg, state)
    root = tmp_path / "ckpt"
    os.rename(root / "iter_0000001", root / ".old_iter_0000001")  # what a crash between the renames leaves

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(CheckpointError, match=r"iter_0000001 is missing and .*\.old_iter_0000001 holds it .*"
                       r"Permission denied.*rename .*\.old_iter_0000001 to .*iter_0000001"):
        load_checkpoint([model], opt, sched, cfg, state)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_stale_aside_folder_is_ignored_by_loading_and_removed_by_the_next_save(tmp_path, fmt):
    """A save that died after renaming the new ``iter_N`` in (while removing ``.old_iter_N``, maybe half
    gone) left that folder for good: only a later save of the same N removed it, one checkpoint's worth
    of disk. Loading and the folder listing ignore it, and the next save of any iteration removes it
    (after its tracker is written); an aside whose ``iter_N`` is missing (the old checkpoint, whole) is
    renamed back instead, whatever iteration the tracker names by then."""
    from megatron_lite.checkpoint.format import iteration_folders, read_tracker

    cfg, state, model, opt, sched = _setup(tmp_path)
    cfg.checkpoint.ckpt_format = fmt
    saved_opt = opt if fmt == "torch" else None
    root = tmp_path / "ckpt"
    _train(model, opt, sched, 1)
    save_checkpoint(1, [model], saved_opt, sched, 4, cfg, state)
    stale = root / ".old_iter_0000001"
    shutil.copytree(root / "iter_0000001", stale)
    os.remove(next(os.path.join(d, f) for d, _, fs in os.walk(stale) for f in fs))  # half removed
    old = _weights(model)
    assert iteration_folders(str(root)) == ["iter_0000001"]
    assert _same(_loaded(tmp_path, cfg, state), old)
    assert read_tracker(str(root)) == 1 and stale.is_dir()  # what every reader (converter, generate.py) asks first
    _train(model, opt, sched, 1)
    save_checkpoint(2, [model], saved_opt, sched, 8, cfg, state)
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]
    os.rename(root / "iter_0000001", root / ".old_iter_0000001")  # a swap of iteration 1 that died between renames
    save_checkpoint(3, [model], saved_opt, sched, 12, cfg, state)  # a run saving on without --load
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "iter_0000003",
                                        "latest_checkpointed_iteration.txt"]
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")
    assert _same(_loaded(tmp_path, cfg, state), old)


def test_an_aside_that_cannot_be_renamed_back_fails_an_async_save_with_a_warning(tmp_path, monkeypatch, capsys):
    """Finalizing an --async-save renames earlier saves' asides back: when that fails, the save fails
    like any async save that cannot finalize (a warning, the previous checkpoint the latest), rather
    than a CheckpointError escaping the training loop's poll."""
    cfg, state, model, opt, sched = _setup(tmp_path)
    cfg.checkpoint.ckpt_format = "torch_dist"
    root = tmp_path / "ckpt"
    save_checkpoint(1, [model], None, sched, 4, cfg, state)
    save_checkpoint(2, [model], None, sched, 8, cfg, state)
    os.rename(root / "iter_0000001", root / ".old_iter_0000001")
    real_rename = os.rename

    def refuse_aside(src, dst):
        if os.path.basename(src).startswith(".old_"):
            raise PermissionError(13, "Permission denied", str(src))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", refuse_aside)
    saves = dist_save.AsyncSaves()
    save_checkpoint(3, [model], None, sched, 12, cfg, state, async_saves=saves)
    saves.wait()
    assert "WARNING: async save of iteration 3" in capsys.readouterr().out
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_temporary_folders_of_killed_saves_are_ignored_and_swept_by_the_next_save(tmp_path, fmt):
    """A save killed mid-write (SIGKILL, power loss) leaves ``.tmp_iter_M``: it was removed only when M
    was saved again, a checkpoint's worth of disk kept for good otherwise. Loading, the folder listing
    and a --load without a tracker ignore such folders (even a complete-looking one), and the next save,
    of any iteration, removes them all."""
    from megatron_lite.checkpoint.format import iteration_folders

    cfg, state, model, opt, sched = _setup(tmp_path)
    cfg.checkpoint.ckpt_format = fmt
    saved_opt = opt if fmt == "torch" else None
    root = tmp_path / "ckpt"
    _train(model, opt, sched, 1)
    save_checkpoint(1, [model], saved_opt, sched, 4, cfg, state)
    old = _weights(model)
    for name in (".tmp_iter_0000007", ".tmp_iter_0000001", ".tmp_release"):  # killed saves, whole-looking
        shutil.copytree(root / "iter_0000001", root / name)
    (root / ".tmp_iter_0000009").mkdir()  # killed before any file
    assert iteration_folders(str(root)) == ["iter_0000001"]
    assert _same(_loaded(tmp_path, cfg, state), old)
    _train(model, opt, sched, 1)
    save_checkpoint(2, [model], saved_opt, sched, 8, cfg, state)
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]
    shutil.copytree(root / "iter_0000001", root / ".tmp_iter_0000003")
    os.remove(root / "latest_checkpointed_iteration.txt")
    shutil.rmtree(root / "iter_0000001")
    shutil.rmtree(root / "iter_0000002")
    assert iteration_folders(str(root)) == []  # a --load here starts from scratch (no refusal, no half checkpoint)
    _, _, fresh, fresh_opt, fresh_sched = _setup(tmp_path, seed=7)
    assert load_checkpoint([fresh], fresh_opt if fmt == "torch" else None, fresh_sched, cfg, state) == (0, 0)


def test_the_sweep_never_touches_the_async_save_in_flight(tmp_path):
    root = tmp_path / "ckpt"
    for name in (".tmp_iter_0000004", ".tmp_iter_0000006", ".old_iter_0000002", "iter_0000002", ".tmp_iter_x"):
        (root / name).mkdir(parents=True)
    dist_save.sweep_temps(str(root), 8, keep=dist_save.temp_dir(str(root), 6))
    assert sorted(os.listdir(root)) == [".old_iter_0000002", ".tmp_iter_0000006", ".tmp_iter_x", "iter_0000002"]
