"""torch_dist saves failing on one rank only (its disk full), under torchrun at 2 ranks
(tests/e2e/fail_save.py injects the faults): every rank agrees the save failed (none waits in a
collective the failed rank skipped), the failed save's temporary folder is removed, the previous
checkpoint stays the latest and resumes on the run's trajectory. A synchronous save exits 2 with one
line; an ``--async-save`` that fails is one warning and training goes on, the last one exits 2."""

import os
import re
import subprocess
import sys
import threading
import time

import pytest

import megatron_lite.checkpoint.dist_save as dist_save
import megatron_lite.training.loop as loop
import pretrain_gpt
from megatron_lite.checkpoint import read_tracker
from megatron_lite.data.indexed_dataset import DataFileError
from megatron_lite.training.nonfinite import NonFiniteError
from tests.e2e.conftest import ROOT
from tests.e2e.test_pretrain_gpt import MODEL, _argv

DIST = ["--ckpt-format", "torch_dist", "--save-interval", "2"]
LOSS = re.compile(r"iteration +(\d+)/.*?lm loss: ([0-9.E+-]+)")


def _torchrun_failing(faults: str, argv: list[str]):
    """``pretrain_gpt.py argv`` on 2 ranks, rank 1's saves failing as ``faults`` says; (exit code of
    the first failed worker or 0, stdout + stderr, {iteration: logged loss})."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "tests/e2e/fail_save.py", "1", faults] + argv
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, MEGATRON_LITE_DEVICE="cpu")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    text = out.stdout + out.stderr
    code = 0 if out.returncode == 0 else int(re.search(r"Root Cause.*?exitcode\s*: (-?\d+)", text, re.S).group(1))
    return code, text, {int(i): float(loss) for i, loss in LOSS.findall(out.stdout)}


def _torchrun_killing(moment: str, iteration: int, argv: list[str]):
    """``pretrain_gpt.py argv`` on 2 ranks, rank 1 killed (SIGKILL) at ``moment`` of the save of
    ``iteration`` (tests/e2e/kill_at.py); (rank 0's exit code, stdout + stderr, {iteration: loss}).
    torchrun checks its workers every 5 s here, not every 0.1 s: the survivor must meet the loss in
    its collectives before its agent stops it, as ranks on other nodes do."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "5", "tests/e2e/kill_at.py", moment, str(iteration)] + argv
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, MEGATRON_LITE_DEVICE="cpu")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    text = out.stdout + out.stderr
    assert re.search(r"\brank\s+: 1 \(local_rank.*?exitcode\s*: -9 ", text, re.S), text[-4000:]  # the peer was killed
    code = int(re.search(r"\brank\s+: 0 \(local_rank.*?exitcode\s*: (-?\d+)", text, re.S).group(1))
    return code, text, {int(i): float(loss) for i, loss in LOSS.findall(out.stdout)}


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _no_temp_folders(save: str) -> None:
    assert [name for name in os.listdir(save) if name.startswith(".")] == [], os.listdir(save)


def _resumes_at_2(tmp_path, save: str, iters: int, logged: dict) -> None:
    """The checkpoint of iteration 2 loads (in one process) and continues the run's trajectory."""
    flags = MODEL + DIST + ["--load", save, "--no-load-rng", "--exit-interval", "4"]
    resumed = pretrain_gpt.main(_argv(str(tmp_path / "resumed"), iters, flags))
    assert resumed.iteration == 4 and len(resumed.losses) == 2
    assert resumed.losses[0] == pytest.approx(logged[3], rel=1e-4)


def test_a_save_failing_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    """Rank 1 fails to write its checksums file (before the collective save): rank 0 used to wait in
    torch.distributed.checkpoint's collectives for it (a hang until the timeout)."""
    save = str(tmp_path / "sync")
    code, text, logged = _torchrun_failing("checksums@4", _argv(save, 6, MODEL + DIST))
    assert code == 2, text[-4000:]
    [line] = _errors(text)
    assert ".tmp_iter_0000004" in line and "No space left on device" in line and "rank 1" in line, line
    assert "[rank" not in text and "Exception in thread" not in text, text[-4000:]  # no rank's traceback
    assert read_tracker(save) == 2 and sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    _resumes_at_2(tmp_path, save, 6, logged)


def test_a_peer_killed_before_the_rename_stops_the_survivor_with_one_line(tmp_path):
    """Rank 1 is killed once its pieces are written, before the ranks agree to rename the folder: rank 0,
    with no error of its own, ended on gloo's RuntimeError traceback ("Connection reset by peer") from
    the agreement. It exits 2 with one line now; nothing is renamed into place, the previous checkpoint
    stays the latest and resumes on the run's trajectory."""
    save = str(tmp_path / "killed")
    code, text, logged = _torchrun_killing("peer:3", 4, _argv(save, 6, MODEL + DIST))
    assert code == 2, text[-4000:]
    [line] = _errors(text)
    assert line.startswith("error: a peer rank stopped (") and "the save of checkpoint iteration 4 into" in line, line
    assert "the previous checkpoint stays the latest" in line, line
    assert "[rank0]" not in text, text[-4000:]  # no traceback of the survivor's
    assert read_tracker(save) == 2 and not os.path.exists(os.path.join(save, "iter_0000004"))
    _resumes_at_2(tmp_path, save, 6, logged)


def test_failed_async_saves_warn_once_and_the_last_one_exits_2(tmp_path):
    """Rank 1's async saves fail three ways (a full disk and a RuntimeError writing its checksums file, a
    piece inside the collective save): one warning each, training goes on, the next save and the end
    of the run do not hang, the last failure exits 2 with one line; no temporary folder is left."""
    save = str(tmp_path / "async")
    code, text, logged = _torchrun_failing("checksums@4,error@6,piece@8", _argv(save, 8, MODEL + DIST + ["--async-save"]))
    assert code == 2, text[-4000:]
    warnings = [line for line in text.splitlines() if line.startswith("WARNING: async save")]
    assert len(warnings) == 2, warnings
    assert "iteration 4" in warnings[0] and "No space left on device" in warnings[0] and "rank 1" in warnings[0]
    assert "iteration 6" in warnings[1] and "RuntimeError: injected fault" in warnings[1] and "rank 1" in warnings[1]
    assert sorted(logged) == list(range(1, 9))  # trained on after each failure
    [line] = _errors(text)
    assert "async save of iteration 8" in line and "No space left on device" in line and "rank 1" in line, line
    assert "[rank" not in text and "Exception in thread" not in text, text[-4000:]
    assert read_tracker(save) == 2
    _no_temp_folders(save)
    _resumes_at_2(tmp_path, save, 8, logged)


def test_a_run_stopping_on_a_nan_finishes_the_async_save_in_flight(tmp_path, monkeypatch, capsys):
    """A NaN stop (exit 1, every rank) while the save of iteration 2 was being written used to exit
    at once: the daemon writer died with the process, the checkpoint a synchronous save would have
    left was lost and its temporary folder stayed. Now the write is finished first (one process)."""
    started, write = threading.Event(), dist_save.write_pieces

    def late_write(pieces, folder, group=None):
        assert started.wait(60)  # still writing when the NaN stop comes
        time.sleep(0.5)  # and for a while after (the old exit did not wait)
        write(pieces, folder, group)

    def nan_at_3(config, state, iteration, loss, grad_norm):
        if iteration == 3:
            started.set()
            raise NonFiniteError(f"iteration {iteration}: injected NaN")

    monkeypatch.setattr(dist_save, "write_pieces", late_write)
    monkeypatch.setattr(loop, "check_finite", nan_at_3)
    save = str(tmp_path / "nan")
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.main(_argv(save, 6, MODEL + DIST + ["--async-save"]))
    assert stop.value.code == 1 and "injected NaN" in capsys.readouterr().err
    assert read_tracker(save) == 2 and sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_an_error_one_rank_meets_alone_finishes_the_async_save_in_flight(tmp_path, monkeypatch, capsys):
    """An error not every rank raises (a bad batch read by one rank) while the save of iteration 2 was
    being written exited at once: the writer died with the process, the checkpoint a synchronous save
    would have left was lost and its temporary folder stayed (one process here; 2 ranks below)."""
    started, write = threading.Event(), dist_save.write_pieces

    def late_write(pieces, folder, group=None):
        assert started.wait(60)
        time.sleep(0.5)
        write(pieces, folder, group)

    def bad_batch_at_3(config, state, iteration, loss, grad_norm):
        if iteration == 3:
            started.set()
            raise DataFileError("--data-path x: injected bad token")

    monkeypatch.setattr(dist_save, "write_pieces", late_write)
    monkeypatch.setattr(loop, "check_finite", bad_batch_at_3)
    save = str(tmp_path / "bad")
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.main(_argv(save, 6, MODEL + DIST + ["--async-save"]))
    assert stop.value.code == 2 and "injected bad token" in capsys.readouterr().err
    assert read_tracker(save) == 2 and sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_a_bad_batch_on_one_rank_during_an_async_save_lands_the_save_and_exits_2(tmp_path):
    """Rank 1 reads a bad batch (iteration 3) while its write of iteration 2 is in flight: it finishes
    that write with rank 0's writer (rank 0's main thread waits for it in the gradient all-reduce),
    then every rank exits 2 with one line; the checkpoint of iteration 2 is the latest, no temporary
    folder is left."""
    save = str(tmp_path / "bad_batch")
    code, text, logged = _torchrun_failing("slow@2,token@5", _argv(save, 6, MODEL + DIST + ["--async-save"]))
    assert code == 2, text[-4000:]
    [line] = _errors(text)
    assert "is outside the tokenizer's vocabulary" in line, line
    assert sorted(logged) == [1, 2], text[-4000:]
    assert read_tracker(save) == 2 and sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
