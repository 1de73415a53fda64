"""Failed saves in one process: the temporary folder is removed, the previous checkpoint stays the
latest, and the --async-save writer thread reports any exception (never finalizing a checkpoint
whose write died). The same at 2 ranks with the fault on one rank: tests/e2e/test_torch_dist_save_failures.py."""

import errno
import os

import pytest

from megatron_lite.checkpoint import (
    CheckpointError,
    dist_save,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from tests.unit.test_checkpointing import _setup, _train


class Died(BaseException):
    """Not an Exception: what a writer thread catching only Exception (or OSError) would let through."""


def _torch_dist(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    cfg.checkpoint.ckpt_format = "torch_dist"
    _train(model, opt, sched, 1)
    save_checkpoint(1, [model], None, sched, 4, cfg, state)  # torch_dist saves the project's optimizers only
    return cfg, state, model, sched


def _only_iteration_1(tmp_path, cfg, state):
    root = tmp_path / "ckpt"
    assert read_tracker(str(root)) == 1
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    _, _, model, _, sched = _setup(tmp_path, seed=3)
    assert load_checkpoint([model], None, sched, cfg, state) == (1, 4)


def test_a_failed_torch_dist_save_removes_its_temporary_folder(tmp_path, monkeypatch):
    cfg, state, model, sched = _torch_dist(tmp_path)
    save = dist_save.atomic_save

    def full_disk(obj, path):
        if "checksums" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        save(obj, path)

    monkeypatch.setattr(dist_save, "atomic_save", full_disk)
    with pytest.raises(CheckpointError, match=r"rank 0 could not write torch_dist checkpoint .*\.tmp_iter_0000002: "
                                              r"OSError: .*No space left on device.*previous checkpoint stays"):
        save_checkpoint(2, [model], None, sched, 8, cfg, state)
    _only_iteration_1(tmp_path, cfg, state)


def test_the_async_writer_reports_any_exception_once_and_never_finalizes(tmp_path, monkeypatch, capsys):
    """A RuntimeError (or a BaseException) escaping the write used to end the writer thread with no
    error recorded: the save was then finalized, the tracker naming a folder without its pieces."""
    cfg, state, model, sched = _torch_dist(tmp_path)
    saves = dist_save.AsyncSaves()
    failure = {"error": RuntimeError("boom")}

    def failing(pieces, folder, group=None):
        raise failure["error"]

    monkeypatch.setattr(dist_save, "write_pieces", failing)
    save_checkpoint(2, [model], None, sched, 8, cfg, state, async_saves=saves)
    saves.wait()
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]
    assert warnings == [f"WARNING: async save of iteration 2 to --save {tmp_path / 'ckpt'} failed: rank 0 could not "
                        f"write torch_dist checkpoint {tmp_path / 'ckpt' / '.tmp_iter_0000002'}: RuntimeError: boom; "
                        "the previous checkpoint stays the latest"]
    _only_iteration_1(tmp_path, cfg, state)
    failure["error"] = Died("the thread died")
    save_checkpoint(3, [model], None, sched, 12, cfg, state, async_saves=saves)
    with pytest.raises(CheckpointError, match=r"async save of iteration 3 .* failed: .*Died: the thread died"):
        saves.wait(final=True)  # the run's last save: an error, not a warning
    assert "WARNING" not in capsys.readouterr().out
    _only_iteration_1(tmp_path, cfg, state)


def _peer_gone_at_agreement(monkeypatch, n: int) -> None:
    """dist_save.agree fails as a lost peer's collective does on its ``n``-th call of the save."""
    real, calls = dist_save.agree, []

    def peer_gone(error, group=None):
        calls.append(error)
        if len(calls) == n:
            raise RuntimeError("Connection closed by peer")
        return real(error, group)

    monkeypatch.setattr(dist_save, "agree", peer_gone)


def test_an_async_save_whose_ranks_cannot_agree_removes_its_temporary_folder(tmp_path, monkeypatch, capsys):
    """A peer killed (SIGKILL) while the writers agree: the agreement fails at once (its connection
    closed) and nothing will ever rename the folder; rank 0 kept it until a later save of that
    iteration. Now it removes it (after a finalize there is nothing left to remove)."""
    cfg, state, model, sched = _torch_dist(tmp_path)
    _peer_gone_at_agreement(monkeypatch, 2)  # the agreement after every rank's write (the first is in write_pieces)
    saves = dist_save.AsyncSaves()
    save_checkpoint(2, [model], None, sched, 8, cfg, state, async_saves=saves)
    saves.wait()
    tmp = tmp_path / "ckpt" / ".tmp_iter_0000002"
    assert (f"failed: a peer rank stopped (Connection closed by peer) during the save of checkpoint iteration 2 into "
            f"{tmp}; nothing was renamed into place, the previous checkpoint stays the latest\n") in capsys.readouterr().out
    _only_iteration_1(tmp_path, cfg, state)


def test_an_async_save_whose_peer_is_lost_after_the_rename_says_it_landed(tmp_path, monkeypatch, capsys):
    """The writers' last agreement (after rank 0 renamed the folder and wrote the tracker) failing: the
    warning said "the previous checkpoint stays the latest" while the tracker named the new one. Its
    words are those of every save that lost a peer now (save_lost.lost_during_save): the new one is the
    latest."""
    cfg, state, model, sched = _torch_dist(tmp_path)
    _peer_gone_at_agreement(monkeypatch, 3)  # in write_pieces, after every rank's write, after the finalize
    saves = dist_save.AsyncSaves()
    save_checkpoint(2, [model], None, sched, 8, cfg, state, async_saves=saves)
    saves.wait()
    root = tmp_path / "ckpt"
    assert (f"failed: a peer rank stopped (Connection closed by peer) during the save of checkpoint iteration 2 into "
            f"{root / '.tmp_iter_0000002'}; {root / 'iter_0000002'} was complete and renamed into place first: it is "
            "the latest checkpoint\n") in capsys.readouterr().out
    assert read_tracker(str(root)) == 2


@pytest.mark.parametrize("where", ["write_pieces", "dcp"])
def test_an_async_save_whose_peer_stopped_says_so(tmp_path, monkeypatch, capsys, where):
    """The agreement inside write_pieces (or DCP's own collectives) failing because a peer rank died
    was reported as this rank's write error: "rank 0 could not write ...: RuntimeError: Connection
    closed by peer". It says that a peer rank stopped now."""
    import torch.distributed.checkpoint as dcp

    cfg, state, model, sched = _torch_dist(tmp_path)
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                          "[127.0.0.1]:29500")

    def gone(*args, **kwargs):
        raise closed

    monkeypatch.setattr(*(dist_save, "agree") if where == "write_pieces" else (dcp, "save"), gone)
    saves = dist_save.AsyncSaves()
    save_checkpoint(2, [model], None, sched, 8, cfg, state, async_saves=saves)
    saves.wait()
    [warning] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]
    assert warning == (f"WARNING: async save of iteration 2 to --save {tmp_path / 'ckpt'} failed: a peer rank stopped "
                       "(Connection closed by peer) during the save of checkpoint iteration 2 into "
                       f"{tmp_path / 'ckpt' / '.tmp_iter_0000002'}; nothing was renamed into place, the previous "
                       "checkpoint stays the latest")
    _only_iteration_1(tmp_path, cfg, state)


def test_a_synchronous_save_whose_peer_stopped_says_so_in_one_line(tmp_path, monkeypatch):
    """Without --async-save the agreement inside write_pieces failing because a peer rank died escaped
    as gloo's raw RuntimeError (a traceback); it is the async path's one-line CheckpointError now."""
    cfg, state, model, sched = _torch_dist(tmp_path)
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                          "[127.0.0.1]:29500")

    def gone(*args, **kwargs):
        raise closed

    monkeypatch.setattr(dist_save, "agree", gone)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(2, [model], None, sched, 8, cfg, state)
    tmp = tmp_path / "ckpt" / ".tmp_iter_0000002"  # a peer may still write into it: the next save removes it
    assert str(err.value) == ("a peer rank stopped (Connection closed by peer) during the save of checkpoint iteration "
                              f"2 into {tmp}; nothing was renamed into place, the previous checkpoint stays the latest "
                              f"(the next save removes {tmp})")
    assert err.value.rank_local  # this rank's alone: the folder is not removed while a peer may write into it
    assert read_tracker(str(tmp_path / "ckpt")) == 1 and not (tmp_path / "ckpt" / "iter_0000002").exists()
    monkeypatch.undo()
    save_checkpoint(2, [model], None, sched, 8, cfg, state)  # the next save: the folder is swept, then written
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]


def test_a_failed_agreement_raises_this_ranks_own_error(monkeypatch):
    """on_every_rank (the synchronous save's steps) after a rank's CheckpointError: its all-gather
    failing (a peer gone) used to replace the message with the collective's RuntimeError. The rank's
    own message stands now, unagreed; with no error of its own the collective's failure propagates."""
    from types import SimpleNamespace

    from megatron_lite.checkpoint import format as ckpt_format

    def gather(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(ckpt_format, "dist", SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                                             get_world_size=lambda: 2, all_gather_object=gather))

    def refuse():
        raise CheckpointError("rank 1 could not write X; the previous checkpoint stays the latest")

    with pytest.raises(CheckpointError, match="^rank 1 could not write X;") as err:
        ckpt_format.on_every_rank(refuse)
    # this rank alone: marked rank-local (it was not, so outside the training loop, at start-up or at the
    # run's last async save, only rank 0 printed it, and nobody when rank 0 was the rank gone)
    assert not getattr(err.value, "on_every_rank", False) and err.value.rank_local
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        ckpt_format.on_every_rank(lambda: None)


def _tracker_write_killed_before_its_rename(root: str) -> None:
    """A process writing the tracker through files.replaced_whole, killed (SIGKILL) before the rename."""
    import signal

    from megatron_lite.files import replaced_whole

    with replaced_whole(os.path.join(root, "latest_checkpointed_iteration.txt")) as tmp:
        with open(tmp, "w") as f:
            f.write("7\n")
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_the_next_save_sweeps_temporary_tracker_files_of_killed_writers_only(tmp_path, fmt):
    """A writer killed between the tracker's write and its rename left
    latest_checkpointed_iteration.txt.tmp.<pid> in the save folder, never removed. The next save
    removes it (and progress.txt's, and this process's own); never one whose writer still lives."""
    from tests.harness import run_in_new_process

    cfg, state, model, opt, sched = _setup(tmp_path)
    cfg.checkpoint.ckpt_format = fmt
    opt = None if fmt == "torch_dist" else opt
    save_checkpoint(1, [model], opt, sched, 4, cfg, state)
    root = str(tmp_path / "ckpt")
    code, _, stderr = run_in_new_process(_tracker_write_killed_before_its_rename, root)
    assert code == -9, stderr[-2000:]
    [killed] = [name for name in os.listdir(root) if ".tmp." in name]
    alive = os.getppid()  # a live process: maybe a writer still at work (another run, the converter)
    leftovers = {f"latest_checkpointed_iteration.txt.tmp.{os.getpid()}", f"progress.txt.tmp.{killed.split('.')[-1]}"}
    kept = {f"latest_checkpointed_iteration.txt.tmp.{alive}", "notes.txt.tmp.1", "latest_checkpointed_iteration.txt.tmp.x"}
    for name in leftovers | kept:
        with open(os.path.join(root, name), "w") as f:
            f.write("2\n")
    assert read_tracker(root) == 1
    save_checkpoint(2, [model], opt, sched, 8, cfg, state)
    assert sorted(os.listdir(root)) == sorted(["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt",
                                               *kept])
    assert read_tracker(root) == 2
