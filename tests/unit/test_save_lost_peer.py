"""A peer rank lost (killed) during a synchronous save, in one process: the agreement after one of the
save's steps fails as gloo's does when the peer's connection closes. A rank with no error of its own
used to end on gloo's RuntimeError (a traceback); it is one CheckpointError line now, saying what is
on disk, and nothing half-written is renamed into place. The same under torchrun, with rank 1 killed:
tests/e2e/test_torch_dist_save_failures.py."""

import os

import pytest

from megatron_lite.checkpoint import CheckpointError, read_tracker, save_checkpoint
from megatron_lite.checkpoint import training as ckpt_training
from megatron_lite.checkpoint.save_lost import SaveProgress, lost_peer_message, peer_lost_as_error
from tests.unit.test_checkpointing import _setup, _train

GLOO = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                    "[127.0.0.1]:19367: Connection reset by peer. This is typically caused by a remote worker hanging "
                    "or bugs in the application.")


def _peer_lost_at(monkeypatch, agreement: int):
    """The ``agreement``-th agreement of the next save fails as gloo's all-gather does when a peer
    rank died (after this rank's part of that step is done)."""
    agree, calls = ckpt_training.on_every_rank, []

    def failing(step):
        calls.append(step)
        if len(calls) == agreement:
            step()
            raise GLOO
        return agree(step)

    monkeypatch.setattr(ckpt_training, "on_every_rank", failing)


def _saved_1(tmp_path, fmt):
    cfg, state, model, opt, sched = _setup(tmp_path)
    cfg.checkpoint.ckpt_format = fmt
    _train(model, opt, sched, 1)
    opt = None if fmt == "torch_dist" else opt  # torch_dist saves the project's optimizers only
    save_checkpoint(1, [model], opt, sched, 4, cfg, state)
    return lambda: save_checkpoint(2, [model], opt, sched, 8, cfg, state)


@pytest.mark.parametrize("fmt, agreement, renamed", [
    ("torch", 1, False), ("torch", 2, False), ("torch", 3, True),  # sweep, files, rename + tracker
    ("torch_dist", 2, False), ("torch_dist", 3, False), ("torch_dist", 4, True),  # small files, pieces, rename
])
def test_a_peer_lost_during_a_save_is_one_line(tmp_path, monkeypatch, fmt, agreement, renamed):
    save = _saved_1(tmp_path, fmt)
    _peer_lost_at(monkeypatch, agreement)
    with pytest.raises(CheckpointError) as err:
        save()
    root = tmp_path / "ckpt"
    head = (f"a peer rank stopped (Connection reset by peer) during the save of checkpoint iteration 2 into "
            f"{root / '.tmp_iter_0000002'}; ")
    if renamed:
        assert str(err.value) == head + f"{root / 'iter_0000002'} was complete and renamed into place first: it is the latest checkpoint"
    else:
        assert str(err.value).startswith(head + "nothing was renamed into place, the previous checkpoint stays the latest")
    assert err.value.rank_local and not getattr(err.value, "on_every_rank", False)  # this rank's: it exits at once
    assert read_tracker(str(root)) == (2 if renamed else 1)
    assert os.path.isdir(root / "iter_0000002") == renamed  # never a half-written folder under the real name


def test_a_lost_peer_in_the_final_step_leaves_other_ranks_unsure():
    """A rank other than 0 cannot know whether rank 0 renamed the folder before the peer was lost."""
    progress = SaveProgress()
    progress.final_step(None)()
    message = lost_peer_message(GLOO, "/ck", 5, progress, rank=1)
    assert message == ("a peer rank stopped (Connection reset by peer) during the save of checkpoint iteration 5 into "
                       "/ck/.tmp_iter_0000005; /ck/latest_checkpointed_iteration.txt names the latest complete "
                       "checkpoint (this one only if rank 0 renamed it into place first)")
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation")
    assert lost_peer_message(timeout, "/ck", 5, SaveProgress(), rank=1).startswith(
        f"the ranks' collectives failed (RuntimeError: {timeout}) during the save of checkpoint iteration 5")


def test_rank_0_knows_it_did_not_rename(tmp_path):
    """Rank 0 lost a peer in the final step before its rename: it knows nothing was renamed (not unsure as
    the other ranks), and names the temporary folder the next save removes only while it exists."""
    def rename():
        raise GLOO
    progress = SaveProgress()
    with pytest.raises(RuntimeError):
        progress.final_step(rename)()
    root, tmp = tmp_path / "ck", tmp_path / "ck" / ".tmp_iter_0000005"
    head = f"a peer rank stopped (Connection reset by peer) during the save of checkpoint iteration 5 into {tmp}; "
    stays = "nothing was renamed into place, the previous checkpoint stays the latest"
    assert lost_peer_message(GLOO, str(root), 5, progress, rank=0) == head + stays
    tmp.mkdir(parents=True)
    assert lost_peer_message(GLOO, str(root), 5, progress, rank=0) == head + stays + f" (the next save removes {tmp})"


def test_other_runtime_errors_pass_unchanged():
    with pytest.raises(RuntimeError, match="^a bug$"), peer_lost_as_error("/ck", 5, SaveProgress()):
        raise RuntimeError("a bug")


def test_a_peer_lost_while_loading_is_one_line(tmp_path, monkeypatch):
    """The ranks agree on a load too (format.on_every_rank): a peer killed meanwhile ended the others
    on gloo's traceback at start-up; one line now, rank-local."""
    cfg, state, model, opt, sched = _setup(tmp_path)
    save_checkpoint(1, [model], opt, sched, 4, cfg, state)

    def gone(step):
        step()
        raise GLOO

    monkeypatch.setattr(ckpt_training, "on_every_rank", gone)
    with pytest.raises(CheckpointError) as err:
        ckpt_training.load_checkpoint([model], opt, sched, cfg, state)
    assert str(err.value) == (f"a peer rank stopped (Connection reset by peer) while loading checkpoint {tmp_path / 'ckpt'}; "
                              "the run stops before training, nothing on disk was changed")
    assert err.value.rank_local


def test_a_peer_lost_at_the_last_async_save_is_one_line(tmp_path, monkeypatch):
    """The ranks agree on the run's last --async-save at its end (AsyncSaves.wait(final=True)); a peer
    killed meanwhile ended a rank whose own write had succeeded on gloo's traceback. One line now."""
    from megatron_lite.checkpoint import dist_save

    cfg, state, model, _, sched = _setup(tmp_path)
    cfg.checkpoint.ckpt_format = "torch_dist"
    saves = dist_save.AsyncSaves()
    save_checkpoint(1, [model], None, sched, 4, cfg, state, async_saves=saves)

    def gone(step):
        step()
        raise GLOO

    monkeypatch.setattr(dist_save, "on_every_rank", gone)
    with pytest.raises(CheckpointError) as err:
        saves.wait(final=True)
    root = tmp_path / "ckpt"
    assert str(err.value) == ("a peer rank stopped (Connection reset by peer) at the end of the run, while the ranks "
                              f"agreed on the --async-save of iteration 1; {root / 'latest_checkpointed_iteration.txt'} "
                              "names the latest complete checkpoint")
    assert err.value.rank_local and read_tracker(str(root)) == 1
