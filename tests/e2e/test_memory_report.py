"""``--memory-report`` through pretrain_gpt.py: printed for the first two steps, model state exact.

The small GPT of test_pretrain_gpt.py (MODEL_B: no biases, hidden 32, so no gradient bucket needs
padding at DP 2) trains 3 steps with the report on. The log has one report line per tracked step
(iterations 1 and 2, not 3), and after each of them the tracker's parameters, gradients and
optimizer state (less Adam's 4-byte step counts) equal :func:`measured_model_state_bytes` and the
per-strategy formula times the parameter count exactly; no activation or communication buffer
outlives a step. The losses are those of the same run without the report (the tracker only watches).
"""

import torch

import pretrain_gpt
from megatron_lite.perf.model_state import measured_model_state_bytes, model_state_bytes_per_param
from tests.e2e.test_pretrain_gpt import MODEL_B, _argv
from tests.harness import run_ranks


def run_with_report(argv):
    """Inside a rank: train; return (losses, parameter count, measured model state, the tracked steps,
    the optimizer's step counters in bytes)."""
    result = pretrain_gpt.main(argv)
    n = sum(p.numel() for c in result.chunks for p in c.parameters())
    counters = 4 * len(result.optimizer.optimizer.state)
    return result.losses, n, measured_model_state_bytes(result.chunks, result.optimizer), result.memory, counters


def _check_steps(steps, measured, counters, per_param, n):
    assert len(steps) == 2
    for step in steps:
        (after,) = step["after"].values()
        b = after.bytes
        assert b["parameters"] == measured["params"] and b["gradients"] == measured["grads"]
        assert b["optimizer state"] == measured["optimizer"] + counters
        assert b["parameters"] + b["gradients"] + b["optimizer state"] - counters == per_param * n
        assert b["activations"] == b["communication"] == 0
        (peak,) = step["peak"].values()
        assert peak.total >= after.total and peak.where
    # step 1 may peak in the optimizer step (Adam's moments are made there); from step 2 on the moments
    # exist all step, and the peak comes while the activations are alive
    (peak,) = steps[1]["peak"].values()
    assert peak.bytes["activations"] > 0 and peak.where.endswith(("in forward", "in backward"))


def test_single_process_report(tmp_path, capsys):
    plain = pretrain_gpt.main(_argv(str(tmp_path / "plain"), 3, MODEL_B)).losses
    capsys.readouterr()
    losses, n, measured, steps, counters = run_with_report(_argv(str(tmp_path / "report"), 3, MODEL_B + ["--memory-report"]))
    assert losses == plain
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("> memory report")]
    assert [x.split("iteration ")[1].split(",")[0] for x in lines] == ["1", "2"]
    assert all("cpu: peak " in x and "temporaries" in x for x in lines)
    _check_steps(steps, measured, counters, model_state_bytes_per_param(torch.float32), n)


def test_zero3_dp2_report(tmp_path):
    argv = _argv(str(tmp_path / "zero3"), 3, MODEL_B + ["--data-parallel-sharding-strategy", "optim_grads_params",
                                                         "--memory-report"])
    for _losses, n, measured, steps, counters in run_ranks(2, run_with_report, argv):
        _check_steps(steps, measured, counters, model_state_bytes_per_param(torch.float32, "optim_grads_params", 2), n)


def test_hsdp_zero2_report_with_tied_embeddings(tmp_path):
    """ZeRO-2 in 2 instances of 2 ranks with the tied word embedding (Megatron's default; MODEL_B unties
    it): the report runs (the tracker's saved-tensor hooks made the tied output layer mark the embedding
    ready after its lookup had: 'a gradient arrived ... already reduced'), the losses are those of the
    run without it, and the model state is the formula's at 2 shards per instance."""
    flags = ["--data-parallel-sharding-strategy", "optim_grads", "--num-distributed-optimizer-instances", "2"]
    plain = run_ranks(4, run_with_report, _argv(str(tmp_path / "plain"), 3, flags))
    reported = run_ranks(4, run_with_report, _argv(str(tmp_path / "report"), 3, flags + ["--memory-report"]))
    per_param = model_state_bytes_per_param(torch.float32, "optim_grads", 4, instances=2)
    for (losses, n, measured, steps, counters), (plain_losses, *_) in zip(reported, plain):
        assert losses == plain_losses
        _check_steps(steps, measured, counters, per_param, n)
