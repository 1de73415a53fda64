"""Which checkpoints a run keeps and which one it loads: --save-retain-interval and the non-persistent
checkpoints delete only older ``iter_XXXXXXX`` folders of their own (never the tracker's, a link, a
``.tmp_iter_*`` being written or anything else), through a rename first so that a deletion killed
half-way leaves every checkpoint whole; --ckpt-step loads the iteration it names (a missing one is one
line naming the folder and the iterations held); --non-persistent-ckpt-type global resumes the newer of
the persistent and non-persistent checkpoints; --exit-on-missing-checkpoint and --no-initialization
stop in one line without a checkpoint. The refused combinations exit 2 with one line."""

import os

import pytest
import torch

from megatron_lite.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_lite.checkpoint.format import iteration_folders
from megatron_lite.checkpoint.load_source import check_no_initialization, load_source
from megatron_lite.checkpoint.pretrained import checkpoint_folder
from megatron_lite.checkpoint.retention import after_save, doomed, prune
from megatron_lite.config import Config
from megatron_lite.models.transformer_config import TransformerConfig
from tests.cli_errors import parse_refused
from tests.unit.test_checkpointing import _setup, _train
from tests.unit.test_training_flag_values import BASE


def _fake(root, *iterations, tracker=None):
    """``iter_N`` folders holding a (dummy) model file, and the tracker."""
    for it in iterations:
        os.makedirs(os.path.join(root, f"iter_{it:07d}", "mp_rank_00_000"))
        open(os.path.join(root, f"iter_{it:07d}", "mp_rank_00_000", "model_optim_rng.pt"), "wb").close()
    if tracker is not None:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(f"{tracker}\n")


def test_retention_deletes_only_older_folders_of_its_own_layout(tmp_path):
    root = str(tmp_path)
    _fake(root, 1, 2, 3, 4, 6, 8, 9, tracker=8)
    os.makedirs(tmp_path / ".tmp_iter_0000010")  # a save being written (--async-save)
    os.makedirs(tmp_path / "iter_5")  # not our layout
    os.makedirs(tmp_path / "iter_0000005_notes")
    os.symlink(tmp_path / "iter_0000001", tmp_path / "iter_0000007")  # a link is never followed nor deleted
    assert doomed(root, 8, 4) == ["iter_0000001", "iter_0000002", "iter_0000003", "iter_0000006"]
    assert doomed(root, 8, 0) == ["iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004", "iter_0000006"]
    _fake(str(tmp_path / "other"), 2, 4, tracker=2)  # the tracker's iteration stays, even when older
    assert doomed(str(tmp_path / "other"), 4, 0) == []
    assert prune(root, 8, 4) == ["iter_0000001", "iter_0000002", "iter_0000003", "iter_0000006"]
    left = sorted(os.listdir(root))
    assert left == [".tmp_iter_0000010", "iter_0000004", "iter_0000005_notes", "iter_0000007", "iter_0000008",
                    "iter_0000009", "iter_5", "latest_checkpointed_iteration.txt", "other"]


def test_a_deletion_killed_half_way_leaves_every_checkpoint_whole(tmp_path):
    """The folder is renamed to .del_iter_N before it is removed: a leftover is no checkpoint (loading and
    the listing ignore it) and the next deletion removes it."""
    root = str(tmp_path)
    _fake(root, 2, 4, tracker=4)
    os.rename(tmp_path / "iter_0000002", tmp_path / ".del_iter_0000002")  # killed between rename and removal
    assert iteration_folders(root) == ["iter_0000004"]
    _fake(root, 6, tracker=6)
    os.makedirs(tmp_path / ".old_iter_0000004")  # a stale copy (a repeated save): never renamed back later
    prune(root, 6, 0)
    assert sorted(os.listdir(root)) == ["iter_0000006", "latest_checkpointed_iteration.txt"]


def test_a_failed_deletion_is_one_warning(tmp_path, monkeypatch, capsys):
    cfg = Config()
    cfg.checkpoint.save, cfg.checkpoint.save_interval, cfg.checkpoint.save_retain_interval = str(tmp_path), 1, 4
    _fake(str(tmp_path), 1, 2, tracker=2)

    def no_permission(*args):
        raise PermissionError(13, "Permission denied", args[0])
    monkeypatch.setattr(os, "rename", no_permission)
    after_save(cfg, str(tmp_path), 2)
    assert "WARNING: could not delete an old checkpoint" in capsys.readouterr().out
    assert iteration_folders(str(tmp_path)) == ["iter_0000001", "iter_0000002"]


def _saves(tmp_path, iterations, root=None):
    cfg, state, model, opt, sched = _setup(tmp_path)
    weights = {}
    for it in iterations:
        _train(model, opt, sched, 1)
        save_checkpoint(it, [model], opt, sched, 4 * it, cfg, state, root=root)
        weights[it] = {k: v.clone() for k, v in model.state_dict().items()}
    return cfg, state, model, opt, sched, weights


def test_ckpt_step_loads_that_iteration_and_a_missing_one_names_what_is_held(tmp_path):
    cfg, state, model, opt, sched, weights = _saves(tmp_path, (2, 4))
    cfg.checkpoint.ckpt_step = 2
    assert load_checkpoint([model], opt, sched, cfg, state) == (2, 8)
    assert all(torch.equal(v, weights[2][k]) for k, v in model.state_dict().items())
    cfg.checkpoint.ckpt_step = 3
    with pytest.raises(CheckpointError) as err:
        load_checkpoint([model], opt, sched, cfg, state)
    assert str(err.value) == (f"--ckpt-step 3: --load {cfg.checkpoint.load} has no checkpoint "
                              f"{cfg.checkpoint.load}/iter_0000003 (iterations held: 2, 4); pick one of them or drop "
                              "--ckpt-step")


def test_an_iteration_folder_names_its_iteration_as_a_number(tmp_path):
    """--ckpt-step with --finetune (or --pretrained-checkpoint DIR/iter_N) loads the folder itself: its
    line said 'iteration iter_0000002' instead of 'iteration 2'."""
    root = str(tmp_path)
    _fake(root, 2, 4, tracker=4)
    assert checkpoint_folder(root, "--load") == (os.path.join(root, "iter_0000004"), 4)
    assert checkpoint_folder(os.path.join(root, "iter_0000002"), "--load") == (os.path.join(root, "iter_0000002"), 2)
    os.makedirs(tmp_path / "release" / "mp_rank_00")
    assert checkpoint_folder(str(tmp_path / "release"), "--load")[1] == "release"


def test_load_resumes_the_newer_of_persistent_and_non_persistent(tmp_path):
    np_root = os.path.join(str(tmp_path / "ckpt"), "non_persistent")
    cfg, state, model, opt, sched, weights = _saves(tmp_path, (2,))
    save_checkpoint(3, [model], opt, sched, 12, cfg, state, root=np_root)
    assert load_source(cfg.checkpoint) == (cfg.checkpoint.load, 2)  # without the type it is not looked at
    cfg.checkpoint.non_persistent_ckpt_type = "global"
    assert load_source(cfg.checkpoint) == (np_root, 3)
    loaded = load_checkpoint([model], opt, sched, cfg, state)
    assert loaded == (3, 12) and loaded.source == np_root
    save_checkpoint(4, [model], opt, sched, 16, cfg, state)  # persistent, newer
    assert load_source(cfg.checkpoint) == (cfg.checkpoint.load, 4)
    cfg.checkpoint.ckpt_step = 2  # names a persistent iteration
    assert load_source(cfg.checkpoint) == (cfg.checkpoint.load, 2)


def test_exit_on_missing_checkpoint_and_no_initialization_need_a_checkpoint(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    cfg.checkpoint.exit_on_missing_checkpoint = True
    with pytest.raises(CheckpointError, match=r"^--exit-on-missing-checkpoint: no checkpoint at --load .*ckpt "
                                              r"\(the folder does not exist\); point --load"):
        load_checkpoint([model], opt, sched, cfg, state)
    cfg.checkpoint.no_initialization = True
    with pytest.raises(CheckpointError, match="--no-initialization skips drawing the initial weights, but --load"):
        check_no_initialization(cfg)
    _saves(tmp_path, (1,))
    check_no_initialization(cfg)  # there is one now


def test_no_initialization_leaves_the_weights_as_allocated():
    cfg = Config()
    cfg.checkpoint.no_initialization = True
    tensor = torch.full((3, 3), 7.0)
    TransformerConfig.from_config(cfg).init_method(1, "w")(tensor)
    assert torch.equal(tensor, torch.full((3, 3), 7.0))


@pytest.mark.parametrize("flags, words", [
    (["--save-retain-interval", "4"], ["--save-retain-interval 4", "add --save DIR and --save-interval N"]),
    (["--save", "s", "--save-interval", "3", "--save-retain-interval", "4"], ["must be a multiple of --save-interval 3"]),
    (["--save", "s", "--save-interval", "2", "--save-retain-interval", "0"], ["--save-retain-interval must be at least 1"]),
    (["--save", "s", "--non-persistent-save-interval", "2"], ["needs --non-persistent-ckpt-type global"]),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"], ["needs --save"]),
    (["--non-persistent-ckpt-type", "local"], ["--non-persistent-ckpt-type local", "nvidia-resiliency-ext",
                                               "use --non-persistent-ckpt-type global"]),
    (["--non-persistent-global-ckpt-dir", "d"], ["needs --non-persistent-ckpt-type global"]),
    (["--save", "s", "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", "./s"],
     ["--non-persistent-global-ckpt-dir ./s is the --save folder", "a folder of its own"]),
    (["--ckpt-step", "4"], ["--ckpt-step 4 picks an iteration of --load: add --load DIR"]),
    (["--exit-on-missing-checkpoint"], ["--exit-on-missing-checkpoint needs --load"]),
    (["--non-persistent-local-ckpt-dir", "d"], ["--non-persistent-local-ckpt-dir", "resiliency"]),
])
def test_refused_combinations(capsys, flags, words):
    parse_refused(capsys, BASE + flags, *words)
