"""User errors through pretrain_gpt.py: exit code 2 on every rank, one line printed once (by rank 0),
no traceback, nothing half-written, and before any training step where the error is knowable then."""

import contextlib
import io
from unittest import mock

import pytest

import pretrain_gpt
from megatron_lite import arguments, errors
from tests.harness import run_ranks

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "123", "--mock-data", "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0",
    "--micro-batch-size", "2", "--global-batch-size", "4",
]


@contextlib.contextmanager
def no_exit_grace():
    """Ranks other than 0 wait PEER_EXIT_GRACE_S (5 s) before an exit every rank takes, so that
    torchrun cannot stop rank 0 before it has printed; a pool has no launcher to race, so its ranks
    skip the wait (test_bad_flag_under_torchrun_is_printed_once keeps it)."""
    with mock.patch.object(errors, "PEER_EXIT_GRACE_S", 0.0), mock.patch.object(arguments, "PEER_EXIT_GRACE_S", 0.0):
        yield


def exit_code_and_stderr(argv):
    """Inside a rank: run main; (exit code, stderr text)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), no_exit_grace():
        try:
            pretrain_gpt.main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


def _every_rank_exits_2_rank_0_prints(world, argv, *words):
    results = run_ranks(world, exit_code_and_stderr, argv)
    assert [code for code, _ in results] == [2] * world, results
    lines = results[0][1].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in results[0][1], results[0][1]
    for w in words:
        assert w in lines[0], lines[0]
    assert all(text == "" for _, text in results[1:]), results


def test_checkpoint_refused_by_one_rank_stops_every_rank_cleanly(tmp_path):
    save = str(tmp_path / "ckpt")
    tp2 = TINY + ["--tensor-model-parallel-size", "2", "--train-iters", "2", "--save", save]
    assert [code for code, _ in run_ranks(2, exit_code_and_stderr, tp2)] == [0, 0]
    bad = tmp_path / "ckpt" / "iter_0000002" / "mp_rank_01_000" / "model_optim_rng.pt"  # rank 1's file only
    bad.write_bytes(bad.read_bytes()[:100])
    longer = ["--train-iters", "4", "--override-opt_param-scheduler"]  # a longer run: its own LR schedule
    _every_rank_exits_2_rank_0_prints(2, tp2 + longer + ["--load", save], "mp_rank_01_000", "unreadable")


def test_bad_flag_combination_is_printed_once(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    _every_rank_exits_2_rank_0_prints(2, TINY + ["--tensor-model-parallel-size", "3", "--train-iters", "2"],
                                      "tensor-model-parallel-size 3")


def test_unknown_flag_is_printed_once():
    results = run_ranks(2, exit_code_and_stderr, TINY + ["--no-such-flag"])
    assert [code for code, _ in results] == [2, 2]
    assert "--no-such-flag" in results[0][1] and results[1][1] == ""


@pytest.mark.parametrize("flags, words", [
    (["--tokenizer-type", "GPTSentencePieceTokenizer"], ["GPTSentencePieceTokenizer needs --tokenizer-model"]),
    (["--tokenizer-type", "GPT2BPETokenizer"], ["GPT2BPETokenizer needs --vocab-file"]),
    (["--tokenizer-type", "BertWordPieceCase"], ["BertWordPieceCase needs --vocab-file"]),
])
def test_tokenizer_without_its_file(capsys, flags, words):
    argv = [a for a in TINY if a != "--mock-data"] + ["--data-path", "x", "--train-iters", "2"] + flags
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for w in words:
        assert w in lines[0], lines[0]


def test_what_cannot_work_at_all_comes_before_what_needs_another_launch(capsys):
    # one process: TP 2 would also need 2 processes, but no launch makes --overlap-param-gather work
    # without --overlap-grad-reduce
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--tensor-model-parallel-size", "2", "--overlap-param-gather",
                                  "--use-distributed-optimizer", "--train-iters", "2"])
    assert err.value.code == 2
    assert "--overlap-param-gather needs --overlap-grad-reduce" in capsys.readouterr().err


def _nan_at_iteration(target, bad=float("nan")):
    """A forward_step whose loss becomes NaN (or ``bad``: inf) from the ``target``-th micro-batch on."""
    real, calls = pretrain_gpt.forward_step, {"n": 0}

    def forward_step(data_iterator, model):
        output, loss_func = real(data_iterator, model)
        calls["n"] += 1
        if calls["n"] < target:
            return output, loss_func

        def nan_loss(output_tensor):
            loss, reported = loss_func(output_tensor * bad)
            return loss, {k: v * bad for k, v in reported.items()}
        return output, nan_loss
    return forward_step


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nan_loss_stops_the_run_naming_iteration_and_rank(tmp_path, capsys, monkeypatch, bad):
    """NaN or inf (troubleshooting.md): an infinite loss stops the run like a NaN one. Without reruns:
    with them, a NaN reproduced with --save exits 16 (tests/e2e/test_rerun.py)."""
    monkeypatch.setattr(pretrain_gpt, "forward_step", _nan_at_iteration(5, float(bad)))  # 2 micro-batches a step
    save = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
                                  "--save", str(save), "--save-interval", "1", "--rerun-mode", "disabled"])
    assert err.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"iteration 3, rank 0: loss {bad} and gradient norm nan" in lines[0], lines
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # the NaN step is not saved


def test_nan_loss_under_fp16_stops_the_run_too(tmp_path, capsys, monkeypatch):
    """The loss scaler skips steps whose gradients overflow, but a NaN forward loss is no overflow (a
    lower scale cannot cure it): the run stops as in bf16 instead of skipping every step to the end."""
    monkeypatch.setattr(pretrain_gpt, "forward_step", _nan_at_iteration(target=5))
    save = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--fp16", "--initial-loss-scale", "1024", "--train-iters", "6",
                                  "--save", str(save), "--save-interval", "1", "--rerun-mode", "disabled"])
    assert err.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "iteration 3, rank 0: loss nan" in lines[0], lines
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_no_check_for_nan_trains_on(monkeypatch):
    monkeypatch.setattr(pretrain_gpt, "forward_step", _nan_at_iteration(target=5))
    result = pretrain_gpt.main(TINY + ["--train-iters", "4", "--no-check-for-nan-in-loss-and-grad"])
    assert result.iteration == 4


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir", "--data-cache-path"])
@pytest.mark.parametrize("problem", ["under a file", "is a file"])
def test_unwritable_output_is_refused_before_the_first_step(tmp_path, capsys, flag, problem):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    path = blocker / "out" if problem == "under a file" else blocker
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--train-iters", "2", flag, str(path)])
    assert err.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and f"{flag} {path}" in lines[0], lines
    assert "iteration" not in captured.out  # refused before training, not at the first save


def test_negative_token_ids_are_one_line(tmp_path, capsys):
    import numpy as np

    from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "neg")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, dtype=np.int32) as b:
        for _ in range(40):
            b.add_item(rng.integers(-3, 50, 40))
            b.end_document()
    argv = [a for a in TINY if a != "--mock-data"] + [
        "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--split", "100,0,0", "--train-iters", "2",
        "--data-cache-path", str(tmp_path / "cache")]
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "negative token id" in lines[0] and prefix in lines[0], lines


def stdout_of_run(argv):
    """Inside a rank: this rank's stdout of a run."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain_gpt.main(argv)
    return out.getvalue()


def test_saving_line_comes_after_its_iteration_line(tmp_path):
    # two pipeline stages: rank 1 prints the iteration lines, so it also prints the saving lines
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--train-iters", "2", "--save", str(tmp_path / "c"),
                   "--save-interval", "1", "--log-interval", "1"]
    first, last = run_ranks(2, stdout_of_run, argv)
    assert "saving checkpoint" not in first
    lines = [line for line in last.splitlines() if "iteration" in line]
    assert "iteration        1/" in lines[0] and "saving checkpoint at iteration       1" in lines[1], lines
    assert "iteration        2/" in lines[3] and "saving checkpoint at iteration       2" in lines[4], lines


def test_bad_flag_under_torchrun_is_printed_once():
    import os
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "pretrain_gpt.py", "--tensor-model-parallel-size", "3"] + TINY
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert text.count("tensor-model-parallel-size 3") == 1, text[-3000:]
    assert "exitcode  : 2" in text  # torchrun's summary: the workers exited with the user-error code


def _bad_batch_argv(bad_rank):
    # two data-parallel ranks, 2 micro-batches a step each: the 5th batch is in iteration 3
    return ["tests/e2e/bad_batch_on_one_rank.py", str(bad_rank), "5"] + TINY + [
        "--micro-batch-size", "1", "--train-iters", "6", "--overlap-grad-reduce"]


def _one_message_no_traceback(text, launcher_tracebacks=0):
    """The message once, no worker traceback (torchrun prints one of its own: ChildFailedError)."""
    assert text.count("error: --data-path") == 1, text[-3000:]
    assert "is outside the tokenizer's vocabulary" in text, text[-3000:]
    assert text.count("Traceback (most recent call last)") == launcher_tracebacks, text[-3000:]
    assert "megatron_lite/" not in text and 'pretrain_gpt.py", line' not in text, text[-3000:]
    assert "gloo/" not in text and "Connection closed" not in text and "RuntimeError" not in text, text[-3000:]


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_bad_batch_on_one_rank_stops_every_rank_with_one_line_exit_2(bad_rank):
    """One rank alone meets the bad token while the other waits for it in the gradient all-reduce:
    both processes (launched one by one, as srun would: rank 0's process serves the store) exit 2,
    the message is printed once."""
    import os
    import socket
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable] + _bad_batch_argv(bad_rank), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"))
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    text = "".join(out + err for out, err in outputs)
    _one_message_no_traceback(text)
    assert "iteration        2/" in text and "iteration        3/" not in text


def test_a_bad_batch_on_rank_0_under_torchrun_is_one_line_exit_2():
    import os
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] + _bad_batch_argv(0)
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    _one_message_no_traceback(text, launcher_tracebacks=1)
    assert "ChildFailedError" in text and "exitcode  : 2" in text and "exitcode  : 1 " not in text, text[-3000:]
