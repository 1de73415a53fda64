"""--async-save with --ckpt-format torch_dist: the save overlaps the next iterations and writes what a
synchronous save writes (the same tables, optimizer state and CRC-32s); a run killed before the save
is finalized resumes from the previous checkpoint, bit-identically; a failed background write is a
warning, and the run's last one failing exits 2 with one line. The format itself: test_torch_dist.py."""

import os
import threading

import megatron_lite.checkpoint.dist_save as dist_save
import megatron_lite.training.step as step
import pretrain_gpt
from megatron_lite.checkpoint import merge_checkpoint, read_tracker
from megatron_lite.checkpoint.dist_read import merge_dist_optimizer, read_index
from tests.e2e import kill_at
from tests.e2e.test_pretrain_gpt import MODEL, _argv, _one_line_exit_2
from tests.e2e.test_torch_dist import DIST, _every_key_checksummed, _same_tables
from tests.harness import run_in_new_process
from tests.trajectory import Trajectory, assert_same_trajectory, run_script


def test_async_save_overlaps_training_and_writes_what_a_sync_save_writes(tmp_path, monkeypatch):
    sync, asyn = str(tmp_path / "sync"), str(tmp_path / "async")
    run = MODEL + ["--save-interval", "2"] + DIST
    pretrain_gpt.main(_argv(sync, 4, run + ["--exit-interval", "2"]))
    steps, trackers = {"n": 0}, []
    finalize_grads, write = step.finalize_model_grads, dist_save.write_pieces
    released = threading.Event()

    def counting(*args, **kwargs):
        finalize_grads(*args, **kwargs)
        steps["n"] += 1
        trackers.append(read_tracker(asyn))
        if steps["n"] == 4:
            released.set()

    def late_write(pieces, folder, group=None):
        assert released.wait(60)  # iterations 3 and 4 run while the save of iteration 2 is in flight
        write(pieces, folder, group)

    monkeypatch.setattr(step, "finalize_model_grads", counting)
    monkeypatch.setattr(dist_save, "write_pieces", late_write)
    pretrain_gpt.main(_argv(asyn, 4, run + ["--async-save"]))
    assert trackers[2:4] == [None, None]  # not finalized while being written
    assert read_tracker(asyn) == 4
    a, b = (os.path.join(root, "iter_0000002") for root in (sync, asyn))
    _same_tables(merge_checkpoint(b)[0], merge_checkpoint(a)[0])
    want, got = merge_dist_optimizer(a), merge_dist_optimizer(b)
    for key in want["state"]:
        _same_tables(got["state"][key], want["state"][key])
    assert got["scheduler"] == want["scheduler"]
    _every_key_checksummed(b)
    assert read_index(b).checksums == read_index(a).checksums  # the same bytes: the same CRC-32s


def test_killed_during_async_save_resumes_from_the_previous_checkpoint(tmp_path):
    save = str(tmp_path / "killed")
    argv = _argv(save, 6, MODEL + DIST + ["--save-interval", "2", "--async-save"])
    code, _, stderr = run_in_new_process(kill_at.main, ["async", "4"] + argv, env={"MEGATRON_LITE_DEVICE": "cpu"})
    assert code == -9, stderr[-2000:]
    assert read_tracker(save) == 2 and not os.path.isdir(os.path.join(save, "iter_0000004"))
    straight = run_script("pretrain_gpt", _argv(str(tmp_path / "straight"), 6, MODEL + DIST))
    resumed = pretrain_gpt.main(argv + ["--load", save])
    assert resumed.iteration == 6
    assert_same_trajectory(Trajectory.of(resumed), straight[2:], rtol=0)  # bit-identical


def test_a_failed_async_save_warns_and_the_last_one_stops_the_run(tmp_path, monkeypatch, capsys):
    """A background write that fails (disk full) mid-run is a warning and the run goes on; the last
    save of the run failing used to end it with exit 0 and no checkpoint: now one line, exit 2, as a
    failed save without --async-save."""
    write = dist_save.write_pieces

    def failing_at(iteration):
        def maybe_fail(pieces, folder, group=None):
            if folder.endswith(f"iter_{iteration:07d}"):
                raise dist_save.CheckpointError(f"could not write torch_dist checkpoint {folder}: No space left")
            write(pieces, folder, group)
        return maybe_fail

    argv = MODEL + DIST + ["--save-interval", "2", "--async-save"]
    monkeypatch.setattr(dist_save, "write_pieces", failing_at(2))
    mid = str(tmp_path / "mid")
    assert pretrain_gpt.main(_argv(mid, 4, argv)).iteration == 4
    assert read_tracker(mid) == 4 and "WARNING: async save of iteration 2" in capsys.readouterr().out
    monkeypatch.setattr(dist_save, "write_pieces", failing_at(4))
    last = str(tmp_path / "last")
    _one_line_exit_2(capsys, _argv(last, 4, argv), "async save of iteration 4 to --save", "No space left")
    assert read_tracker(last) == 2
