"""Resuming with other optimizer flags than the checkpoint's: another --optimizer is refused in one
line (both checkpoint formats, both optimizers)."""

import pytest

import pretrain_gpt

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "123", "--make-vocab-size-divisible-by", "8", "--mock-data", "--lr", "1e-2",
    "--log-interval", "10", "--eval-iters", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
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
