"""Optimizer and loss-scale flags through pretrain_gpt.py. Resuming with other optimizer flags than
the checkpoint's: another --optimizer is refused in one line; other --adam-beta1/2, --adam-eps,
--sgd-momentum are this run's and the log says so (both checkpoint formats, both optimizers); --fp16
may switch between a static and a dynamic loss scale. --loss-scale also scales bf16 (as in
Megatron-LM) without changing what is learned. Another --fp8-amax-history-len keeps the FP8 scales."""

import pytest
import torch

import pretrain_gpt
from megatron_lite.precision.fp8 import fp8_gemms
from tests.trajectory import Trajectory, assert_same_trajectory

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "123", "--make-vocab-size-divisible-by", "8", "--mock-data", "--lr", "1e-2",
    "--log-interval", "10", "--eval-iters", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr-decay-iters", "4",
]


def _run(save, iters, *extra, load=False):
    argv = TINY + ["--train-iters", str(iters), "--save", save] + (["--load", save] if load else []) + list(extra)
    return pretrain_gpt.main(argv)


@pytest.mark.parametrize("saved, resumed", [("adam", "sgd"), ("sgd", "adam")])
@pytest.mark.parametrize("flags", [[], ["--use-distributed-optimizer"], ["--ckpt-format", "torch_dist"]])
def test_resume_with_another_optimizer_is_one_line_exit_2(tmp_path, capsys, saved, resumed, flags):
    save = str(tmp_path / "ckpt")
    _run(save, 1, "--optimizer", saved, *flags)
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        _run(save, 2, "--optimizer", resumed, *flags, load=True)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"holds {saved} state, this run uses --optimizer {resumed}" in lines[0], lines[0]
    assert "--no-load-optim" in lines[0]


@pytest.mark.parametrize("flags", [[], ["--use-distributed-optimizer"], ["--ckpt-format", "torch_dist"]])
@pytest.mark.parametrize("optimizer, changed, expected", [
    ("adam", ["--adam-beta2", "0.5", "--adam-eps", "1e-3"], {"betas": (0.9, 0.5), "eps": 1e-3}),
    ("sgd", ["--sgd-momentum", "0.25"], {"momentum": 0.25}),
])
def test_resume_with_other_optimizer_values_uses_this_runs(tmp_path, capsys, flags, optimizer, changed, expected):
    save = str(tmp_path / "ckpt")
    _run(save, 1, "--optimizer", optimizer, *flags)
    capsys.readouterr()
    result = _run(save, 2, "--optimizer", optimizer, *flags, *changed, load=True)
    for group in result.optimizer.param_groups:  # what the torch optimizer steps with
        assert {k: group[k] for k in expected} == expected
    out = capsys.readouterr().out
    assert "optimizer flags that differ from the checkpoint's, this run's used" in out
    assert f"{changed[0]} {changed[1]} (checkpoint " in out


@pytest.mark.parametrize("saved, resumed, scale", [
    ([], ["--loss-scale", "1024"], 1024.0),  # this run's static scale, not the checkpoint's dynamic one
    (["--loss-scale", "1024"], [], 1024.0),  # dynamic from the static checkpoint's scale (was a KeyError)
])
def test_resume_switching_between_static_and_dynamic_loss_scale(tmp_path, saved, resumed, scale):
    save = str(tmp_path / "ckpt")
    _run(save, 1, "--fp16", *saved)
    result = _run(save, 2, "--fp16", *resumed, load=True)
    assert len(result.grad_norms) == 1
    assert result.optimizer.get_loss_scale() == scale


def test_model_state_line_waits_for_the_first_update(tmp_path, capsys):
    """fp16's first steps overflow and are skipped: the bytes line comes after the first update, when
    Adam's moments exist (it showed 4 optimizer bytes per parameter instead of 12 before)."""
    _run(str(tmp_path / "ckpt"), 3, "--fp16", "--initial-loss-scale", "1e6", "--hysteresis", "1", "--log-interval", "1")
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "model state on this rank" in x)
    assert "optimizer 12.00 = device 18.00" in line and "device 18.00, CPU" in line, line
    assert out.index("iteration        2/") < out.index(line), "printed after the skipped steps"


def test_bf16_static_loss_scale_is_applied_and_undone(tmp_path, capsys):
    """bf16 with --loss-scale 1024: the log shows the scale, and the trajectory is bf16's without it
    (the gradients are divided back before clipping and the step; measured: equal to the bit)."""
    plain = Trajectory.of(_run(str(tmp_path / "a"), 3, "--bf16"))
    capsys.readouterr()
    scaled = _run(str(tmp_path / "b"), 3, "--bf16", "--loss-scale", "1024", "--log-interval", "1")
    assert "loss scale: 1024.0 |" in capsys.readouterr().out
    assert scaled.optimizer.get_loss_scale() == 1024.0
    assert_same_trajectory(Trajectory.of(scaled), plain, rtol=1e-6)


def _fp8_state(result):
    gemms = fp8_gemms(result.chunks)
    return [g.scale.clone() for g in gemms], [g.amax_history.shape[0] for g in gemms]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("saved_len, resumed_len", [(4, 1), (1, 3)])
def test_resume_with_another_fp8_amax_history_len_keeps_the_scales(tmp_path, fmt, saved_len, resumed_len):
    """Another --fp8-amax-history-len on resume (was refused as a shape mismatch of amax_history): the
    saved scales are loaded, the histories start over at this run's length (an all-zero history keeps
    a scale until the next amaxes are recorded)."""
    save, fp8 = str(tmp_path / "ckpt"), ["--bf16", "--fp8-format", "hybrid", "--ckpt-format", fmt]
    first = _run(save, 2, *fp8, "--fp8-amax-history-len", str(saved_len))
    scales, _ = _fp8_state(first)
    assert any(not torch.equal(s, torch.ones_like(s)) for s in scales)  # learned, not the initial 1s
    loaded = _run(save, 2, *fp8, "--fp8-amax-history-len", str(resumed_len), "--no-load-rng", load=True)
    loaded_scales, lengths = _fp8_state(loaded)
    assert all(torch.equal(a, b) for a, b in zip(loaded_scales, scales))
    assert set(lengths) == {resumed_len}
    assert all(not g.amax_history.any() for g in fp8_gemms(loaded.chunks))
    _run(save, 3, *fp8, "--fp8-amax-history-len", str(resumed_len), "--no-load-rng", load=True)  # and it trains on
