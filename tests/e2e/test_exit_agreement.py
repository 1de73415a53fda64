"""--exit-signal-handler under several ranks: a SIGTERM that reaches one rank only (a scheduler, or a
user, signalling one worker) stops every rank after the same step, with the checkpoint saved
(troubleshooting.md). The ranks agree through one small all-reduce per step; without it the signalled
rank would leave and the others would wait for it in their next collective."""

import os
import signal

import pytest

import pretrain_gpt
from tests.harness import run_ranks

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--mock-data", "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--log-interval", "1", "--eval-iters", "0", "--train-iters", "50", "--exit-signal-handler"]


def _signal_one_rank(signalled_rank, at_call, argv):
    """Inside a rank: train, sending this process SIGTERM in its ``at_call``-th forward step if it is
    ``signalled_rank``; (exit reason, iteration). The pool worker's SIGTERM handler is given back."""
    import torch.distributed as dist

    previous, real, calls = signal.getsignal(signal.SIGTERM), pretrain_gpt.forward_step, {"n": 0}

    def forward_step(data_iterator, model):
        calls["n"] += 1
        if dist.get_rank() == signalled_rank and calls["n"] == at_call:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(data_iterator, model)

    pretrain_gpt.forward_step = forward_step
    try:
        result = pretrain_gpt.main(argv)
        return result.exit_reason, result.iteration
    finally:
        pretrain_gpt.forward_step = real
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("layout, signalled_rank, at_call", [
    ([], 1, 3),  # DP 2: one micro-batch a step on each rank, so the 3rd call is step 3's
    (["--pipeline-model-parallel-size", "2"], 0, 5),  # PP 2: two micro-batches a step; the first stage, 3rd step
])
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, layout, signalled_rank, at_call):
    save = tmp_path / "ckpt"
    results = run_ranks(2, _signal_one_rank, signalled_rank, at_call, TINY + layout + ["--save", str(save)])
    assert results == [("signal", 3)] * 2
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"



@pytest.mark.parametrize("signalled", [False, True])
def test_the_sigterm_handler_is_given_back_when_the_run_returns(tmp_path, monkeypatch, signalled):
    """pretrain() installs its SIGTERM handler first thing; it left it installed when it returned, so a
    process that went on (a notebook, a test worker, a script training twice) ignored every later
    SIGTERM. Now the process's own handler is back, whether the run ended on a signal or not."""
    real, calls = pretrain_gpt.forward_step, {"n": 0}

    def forward_step(data_iterator, model):
        calls["n"] += 1
        if signalled and calls["n"] == 3:  # two micro-batches a step: step 2
            os.kill(os.getpid(), signal.SIGTERM)
        return real(data_iterator, model)

    def mine(signum, frame):
        pass

    monkeypatch.setattr(pretrain_gpt, "forward_step", forward_step)
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        result = pretrain_gpt.main(TINY[:-3] + ["--train-iters", "3", "--exit-signal-handler",
                                                "--save", str(tmp_path / "ckpt")])
        assert (result.exit_reason, result.iteration) == (("signal", 2) if signalled else ("done", 3))
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("save", [True, False])
def test_ctrl_c_ends_a_run_with_one_line_naming_the_checkpoint_to_resume(tmp_path, monkeypatch, capsys, save):
    """Ctrl-C (KeyboardInterrupt) in a step printed a 30-line traceback on every rank and exited 1;
    now rank 0 prints one line saying where the run stopped and what --save holds, and the exit code
    is 130 (a shell's for SIGINT)."""
    from megatron_lite.errors import run_script

    real, calls = pretrain_gpt.forward_step, {"n": 0}

    def forward_step(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == 4:  # two micro-batches a step on one rank: step 2's second
            raise KeyboardInterrupt
        return real(data_iterator, model)

    monkeypatch.setattr(pretrain_gpt, "forward_step", forward_step)
    ckpt = str(tmp_path / "ckpt")
    argv = [a for a in TINY if a != "--exit-signal-handler"] + (["--save", ckpt, "--save-interval", "1"] if save else [])
    with pytest.raises(SystemExit) as exit_:
        run_script(lambda: pretrain_gpt.main(argv))
    assert exit_.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    kept = (f"the last checkpoint is iteration 1 in {ckpt} (resume with --load {ckpt})" if save
            else "nothing is saved (no --save)")
    assert err == [f"interrupted (Ctrl-C): stopped in iteration 2; {kept}"]
