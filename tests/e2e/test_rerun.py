"""--rerun-mode validate_results through pretrain_gpt.py: a failed result check reruns the step on the
same micro-batches and generator states; a fault the rerun does not reproduce exits 17 with nothing of
that step saved, a reproduced NaN saves the checkpoint before the step and exits 16 (with --save; without,
it stops as before), the restarted job reruns it on other hardware and exits 17 with the verdict; spiky
losses / large gradients train on. Fault injection (--error-injection-rate / --error-injection-type)
drives each path; --iterations-to-skip, --result-rejected-tracker-filename and
--check-weight-hash-across-dp-replicas-interval (DP2 runs)."""

import contextlib
import io
import json
import os
import re
from unittest import mock

import pytest
import torch

import pretrain_gpt
from megatron_lite.training import loop, rerun, rerun_resume
from tests.e2e.test_user_errors import TINY, exit_code_and_stderr
from tests.harness import run_ranks

RUN = TINY + ["--train-iters", "5", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # 2 micro-batches a step


def _scaled_at(calls_to_scale, factor):
    """A forward_step whose loss (and so its gradients) is ``factor`` times the real one at the given
    forward calls (counted from 1 over the run, reruns included)."""
    real, calls = pretrain_gpt.forward_step, {"n": 0}

    def forward_step(data_iterator, model):
        output, loss_func = real(data_iterator, model)
        calls["n"] += 1
        if calls["n"] not in calls_to_scale:
            return output, loss_func

        def scaled(output_tensor):
            loss, reported = loss_func(output_tensor * factor)
            return loss, {k: v * factor for k, v in reported.items()}
        return output, scaled
    return forward_step


def _run(argv, capsys=None):
    result = pretrain_gpt.main(argv)
    out = capsys.readouterr().out if capsys is not None else ""
    return result, [line for line in out.splitlines() if "result check failed" in line]


def _exit(argv, capsys):
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return err.value.code, lines[0]


@pytest.fixture(scope="module")
def clean():
    return pretrain_gpt.main(RUN)


def test_injected_transient_error_exits_17_saving_nothing_of_that_step(tmp_path, capsys):
    save = tmp_path / "ckpt"
    code, line = _exit(RUN + ["--error-injection-rate", "1", "--save", str(save), "--save-interval", "1"], capsys)
    assert code == rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION == 17
    assert "iteration 2: the rerun of the step did not reproduce an injected transient_error" in line, line
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"  # the first step is not checked
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000001"]


def test_a_real_transient_nan_exits_17_and_disabled_stops_on_it(tmp_path, capsys, monkeypatch):
    """A NaN loss at one forward call only (the 5th micro-batch: step 3): the rerun's loss is finite."""
    monkeypatch.setattr(pretrain_gpt, "forward_step", _scaled_at({5}, float("nan")))
    code, line = _exit(RUN, capsys)
    assert code == 17 and "iteration 3: the rerun of the step did not reproduce a NaN/inf loss" in line, line
    monkeypatch.setattr(pretrain_gpt, "forward_step", _scaled_at({5}, float("nan")))
    code, line = _exit(RUN + ["--rerun-mode", "disabled"], capsys)  # no rerun: today's stop
    assert code == 1 and "iteration 3, rank 0: loss nan" in line, line


def test_injected_persistent_error_exits_16_then_17_on_other_hardware(tmp_path, capsys, monkeypatch):
    """Reproduced on the same hardware: checkpoint 1 saved with the step to rerun, exit 16. Restarted on
    the same node and device: exit 16 again, nothing saved; on another: the injected persistent error
    differs there, exit 17; resumed with --rerun-mode disabled the pending rerun is ignored."""
    save = tmp_path / "ckpt"
    argv = RUN + ["--save", str(save), "--save-interval", "1", "--load", str(save)]
    inject = ["--error-injection-rate", "1", "--error-injection-type", "persistent_error"]
    code, line = _exit(argv + inject, capsys)
    assert code == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE == 16, line
    assert "iteration 2: the rerun of the step reproduced an injected persistent_error on the same hardware: " \
           f"saved checkpoint 1 in {save}" in line, line
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000001"]
    state = json.loads((save / "iter_0000001" / "rerun_state" / "rank_00000.json").read_text())
    assert state["iteration"] == 1 and state["failed"] and state["injected"] == "persistent_error", state
    code, line = _exit(argv + inject, capsys)
    assert code == 16 and "iteration 2: restarted on the hardware that computed" in line, line
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    monkeypatch.setattr(rerun_resume, "host_and_device", lambda: ("another-node", "cpu"))
    code, line = _exit(argv + inject, capsys)
    assert code == 17 and "did not reproduce an injected persistent_error: the first hardware computed a wrong " \
                          "result twice" in line, line
    result = pretrain_gpt.main(argv + ["--rerun-mode", "disabled"])
    assert "the pending rerun of iteration 2 (exit 16) is ignored" in capsys.readouterr().out
    assert result.iteration == 5 and len(result.losses) == 4


def test_a_reproduced_nan_is_rerun_elsewhere_and_the_tracker_skips_it(tmp_path, capsys, monkeypatch):
    """A NaN loss in step 3 and its rerun: checkpoint 2 saved then (with the step's starting RNG states),
    exit 16; on other hardware step 3 gives the NaN again and its other micro-batch's loss bit for bit
    (dropout on: the same data and masks), exit 17 (the data's); the tracker file then holds two
    reproductions of iteration 2 on rank 0: the next start skips it."""
    save, tracker = tmp_path / "ckpt", tmp_path / "rejected.txt"
    argv = RUN + ["--save", str(save), "--load", str(save), "--ckpt-format", "torch_dist",  # saved at exit 16 only
                  "--result-rejected-tracker-filename", str(tracker)]
    monkeypatch.setattr(pretrain_gpt, "forward_step", _scaled_at({5, 7}, float("nan")))
    code, line = _exit(argv, capsys)
    assert code == 16 and "iteration 3: the rerun of the step reproduced a NaN/inf loss or gradient" in line, line
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    lines = tracker.read_text().splitlines()
    assert [x.split(" status=")[1].split()[0] for x in lines] == ["initial_run", "first_rerun_reproducible"], lines
    assert all(" rank=0 iteration=2 " in x and "result=[nan," in x for x in lines), lines
    monkeypatch.setattr(rerun_resume, "host_and_device", lambda: ("another-node", "cpu"))
    monkeypatch.setattr(pretrain_gpt, "forward_step", _scaled_at({1}, float("nan")))
    code, line = _exit(argv, capsys)
    assert code == 17 and "reproduced a NaN/inf loss or gradient: the result is the data's" in line, line
    assert "status=second_rerun_reproducible" in tracker.read_text().splitlines()[-1]
    monkeypatch.undo()
    result = pretrain_gpt.main(argv)
    out = capsys.readouterr().out
    assert "skipping iterations [2]" in out and "pending rerun of iteration 3 (exit 16) is dropped" in out, out
    assert result.iteration == 5 and len(result.losses) == 2 and result.consumed_samples == 20


def _nan_loss_on_rank_1(argv):
    """Inside a rank: rank 1's loss is NaN in step 2 and its rerun (one micro-batch per rank and step)."""
    if int(os.environ["RANK"]) == 1:
        with mock.patch.object(pretrain_gpt, "forward_step", _scaled_at({2, 3}, float("nan"))):
            return exit_code_and_stderr(argv)
    return exit_code_and_stderr(argv)


def test_at_dp2_only_the_rank_whose_loss_failed_is_the_one_to_move(tmp_path):
    """Rank 1's NaN loss reaches rank 0's gradients through the reduction, but only rank 1 failed at
    the source: its record alone says so (so only its node and device must change for the rerun) and
    the tracker file has its lines alone (so the skip rule can count them)."""
    save, tracker = tmp_path / "ckpt", tmp_path / "rejected.txt"
    argv = RUN + ["--save", str(save), "--result-rejected-tracker-filename", str(tracker)]
    results = run_ranks(2, _nan_loss_on_rank_1, argv)
    assert [code for code, _ in results] == [16, 16], results
    states = [json.loads((save / "iter_0000001" / "rerun_state" / f"rank_{r:05d}.json").read_text()) for r in (0, 1)]
    assert [s["failed"] for s in states] == [False, True], states
    lines = tracker.read_text().splitlines()
    assert len(lines) == 2 and all(" rank=1 iteration=1 " in x for x in lines), lines


def test_without_save_a_reproduced_error_stops_like_a_nan(capsys):
    code, line = _exit(RUN + ["--error-injection-rate", "1", "--error-injection-type", "persistent_error"], capsys)
    assert code == 1 and "iteration 2: the rerun of the step reproduced an injected persistent_error" in line, line


def test_injected_correct_result_trains_on_the_same_trajectory(clean, capsys):
    """Every checked step (2..5) is rerun with dropout on: the same batches and masks give the run
    without injection bit for bit."""
    result, lines = _run(RUN + ["--error-injection-rate", "1", "--error-injection-type", "correct_result"], capsys)
    assert len(lines) == 4 and "iteration 2:" in lines[0] and "reproduced it" in lines[0], lines
    assert result.losses == clean.losses and result.grad_norms == clean.grad_norms


def test_a_transient_spiky_loss_trains_on_the_reruns_result(clean, capsys, monkeypatch):
    monkeypatch.setattr(rerun, "REFERENCE_SAMPLES", 2)  # the reference: steps 2's two micro-batches
    monkeypatch.setattr(pretrain_gpt, "forward_step", _scaled_at({9}, 1000.0))  # step 5's first micro-batch
    result, lines = _run(RUN + ["--check-for-spiky-loss"], capsys)
    assert len(lines) == 1 and "iteration 5:" in lines[0] and "did not reproduce it (transient)" in lines[0], lines
    assert result.losses == clean.losses and result.grad_norms == clean.grad_norms


def test_reproduced_large_gradients_are_trained_on(clean, capsys, monkeypatch):
    monkeypatch.setattr(rerun, "REFERENCE_SAMPLES", 2)  # steps 2 and 3
    monkeypatch.setattr(pretrain_gpt, "forward_step", _scaled_at({7, 9}, 1000.0))  # step 4 and its rerun
    result, lines = _run(RUN + ["--check-for-large-grads", "--no-check-for-nan-in-loss-and-grad"], capsys)
    assert len(lines) == 1 and "iteration 4:" in lines[0] and "reproduced it" in lines[0], lines
    assert result.losses[:3] == clean.losses[:3] and result.losses[3] > 100 * clean.losses[3]


def test_iterations_to_skip_read_the_batch_and_train_nothing(clean, capsys):
    result = pretrain_gpt.main(RUN + ["--iterations-to-skip", "1", "3"])
    out = capsys.readouterr().out
    assert "iteration 2 skipped (--iterations-to-skip 1)" in out
    assert re.search(r"iteration +3/ +5 \| consumed samples: +12 \|", out), out  # the skipped batch counts
    assert result.iteration == 5 and result.consumed_samples == 20 and len(result.losses) == 3
    assert result.losses[0] == clean.losses[0] and result.losses[1] != clean.losses[1]


def test_every_rank_takes_the_rerun_decision_at_dp2():
    """Rate 2: at each checked step one of the two ranks injects; both rerun and both exit 17. The
    weight hashes, checked before the first step and after it, match (a line each)."""
    argv = RUN + ["--error-injection-rate", "2", "--check-weight-hash-across-dp-replicas-interval", "1"]
    results = run_ranks(2, _code_err_out, argv)
    assert [code for code, _, _ in results] == [17, 17], results
    assert "did not reproduce an injected transient_error" in results[0][1] and results[1][1] == "", results
    assert results[0][2].count("weight hashes match across data-parallel replicas") == 2, results[0][2]


def _code_err_out(argv, perturb_rank=None):
    """Inside a rank: (exit code, stderr, stdout) of pretrain_gpt.main; on ``perturb_rank`` one weight
    is nudged after the second step (a fault on that replica only)."""
    real = loop.train_step

    def train_step(config, comm, chunks, *args, **kwargs):
        out = real(config, comm, chunks, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2 and int(os.environ["RANK"]) == perturb_rank:
            with torch.no_grad():
                next(p for n, p in chunks[0].named_parameters() if "mlp" in n).view(-1)[3] += 1e-3
        return out
    calls = []
    with mock.patch.object(loop, "train_step", train_step), contextlib.redirect_stdout(io.StringIO()) as out:
        code, err = exit_code_and_stderr(argv)
    return code, err, out.getvalue()


def test_weight_hash_names_the_replica_that_differs_with_the_distributed_optimizer():
    """A weight nudged on rank 1 after step 2 (ZeRO-1: the replicated weights are compared, not the
    sharded masters): both ranks stop after iteration 2, exit 1, one line naming rank 1 and the weight."""
    argv = RUN + ["--check-weight-hash-across-dp-replicas-interval", "1", "--use-distributed-optimizer",
                  "--rerun-mode", "disabled"]
    results = run_ranks(2, _code_err_out, argv, 1)
    assert [code for code, _, _ in results] == [1, 1], results
    line = results[0][1].strip()
    assert "\n" not in line and results[1][1] == "", results
    assert "after iteration 2 the data-parallel replicas' weights differ (rank 1 differs from rank 0, first in " in line
    assert "mlp" in line and results[0][2].count("weight hashes match") == 2, results


@pytest.mark.parametrize("flags, words", [
    (["--rerun-mode", "report_stats"], "--rerun-mode report_stats"),
    (["--rerun-mode", "disabled", "--check-for-spiky-loss"], "--check-for-spiky-loss needs --rerun-mode"),
    (["--error-injection-rate", "1", "--no-check-for-nan-in-loss-and-grad"], "no check is on"),
    (["--error-injection-rate", "-1"], "--error-injection-rate must be at least 0"),
    (["--iterations-to-skip", "-2"], "--iterations-to-skip counts iterations from 0"),
    (["--check-for-large-grads", "--num-experts", "2"], "--check-for-large-grads with --num-experts"),
    (["--check-weight-hash-across-dp-replicas-interval", "0"], "must be at least 1"),
    (["--result-rejected-tracker-filename", "/"], "--result-rejected-tracker-filename / is a folder; name a file"),
    (["--check-weight-hash-across-dp-replicas-interval", "5", "--data-parallel-sharding-strategy",
      "optim_grads_params"], "no replica to compare"),
])
def test_refused_combinations_are_one_line(capsys, flags, words):
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(RUN + flags)
    assert err.value.code == 2
    assert words in capsys.readouterr().err


def test_a_rerun_logs_a_specs_auxiliary_loss_once():
    """A --spec module's logged loss (examples/research/aux_loss.py) is the rerun's alone, not both passes'."""
    spec = RUN + ["--spec", "examples/research/aux_loss.py", "spec"]
    clean = pretrain_gpt.main(spec)
    result = pretrain_gpt.main(spec + ["--error-injection-rate", "1", "--error-injection-type", "correct_result"])
    assert len(clean.reported[0]) == 2 and result.reported == clean.reported, (clean.reported, result.reported)
