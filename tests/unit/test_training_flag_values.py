"""Nonsense values of the numeric training flags are refused while parsing, in one line naming the flag
(exit code 2), and the limits themselves are accepted. Argument parsing only: no model, no data."""

import pytest

from megatron_lite.arguments import parse_args
from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10"]


@pytest.mark.parametrize("flags, words", [
    # the clipping step read every --clip-grad <= 0 as "off"; a negative value was accepted silently
    (["--clip-grad", "-1"], ["--clip-grad must be at least 0", "0 disables clipping", "-1.0"]),
    (["--clip-grad=-1e-9"], ["--clip-grad must be at least 0"]),
    (["--weight-decay", "-0.01"], ["--weight-decay must be at least 0"]),
    (["--adam-eps", "0"], ["--adam-eps must be positive", "NaN"]),
    (["--adam-eps=-1e-8"], ["--adam-eps must be positive"]),
    (["--adam-beta1", "1"], ["--adam-beta1 must be in [0, 1)"]),
    (["--adam-beta1", "-0.1"], ["--adam-beta1 must be in [0, 1)"]),
    (["--adam-beta2", "1.5"], ["--adam-beta2 must be in [0, 1)"]),
    (["--lr-warmup-fraction", "1.5"], ["--lr-warmup-fraction must be in [0, 1)"]),
    (["--lr-warmup-fraction", "-0.1"], ["--lr-warmup-fraction must be in [0, 1)"]),
    (["--lr", "0.1", "--min-lr", "0.2"], ["--min-lr 0.2 is larger than --lr 0.1"]),
    (["--lr=-1e-4"], ["--lr must be at least 0"]),
    (["--hidden-dropout", "-0.1"], ["--hidden-dropout must be in [0, 1)"]),
    (["--hidden-dropout", "1"], ["--hidden-dropout must be in [0, 1)"]),
    (["--attention-dropout", "-0.1"], ["--attention-dropout must be in [0, 1)"]),
    (["--attention-dropout", "1.0"], ["--attention-dropout must be in [0, 1)"]),
    (["--sgd-momentum", "-0.5", "--optimizer", "sgd"], ["--sgd-momentum must be at least 0"]),
    (["--sgd-momentum", "1", "--optimizer", "sgd"], ["--sgd-momentum must be less than 1", "got 1.0"]),
    (["--sgd-momentum", "1.5", "--optimizer", "sgd"], ["--sgd-momentum must be less than 1"]),
    # nan passes every range check (its comparisons are all False); inf only where it means "no limit"
    (["--clip-grad", "nan"], ["--clip-grad must be a finite number", "nan"]),
    (["--lr", "nan"], ["--lr must be a finite number"]),
    (["--lr", "inf"], ["--lr must be a finite number", "inf"]),
    (["--weight-decay", "inf"], ["--weight-decay must be a finite number"]),
    (["--hidden-dropout", "nan"], ["--hidden-dropout must be a finite number"]),
    (["--num-experts", "2", "--moe-aux-loss-coeff", "0.1", "nan"], ["--moe-aux-loss-coeff must be a finite number"]),
    # multi-token prediction depth k needs a token k + 1 ahead: at --seq-length 16, depth 16 had none (loss 0)
    (["--position-embedding-type", "rope", "--mtp-num-layers", "16"],
     ["--mtp-num-layers 16 must be less than --seq-length 16", "use fewer MTP layers or a longer --seq-length"]),
])
def test_nonsense_values_are_refused_in_one_line(capsys, flags, words):
    parse_refused(capsys, BASE + flags, *words, world_size=1)


@pytest.mark.parametrize("flags, name, value", [
    (["--clip-grad", "0"], "clip_grad", 0.0),  # 0 disables clipping, as in Megatron-LM
    (["--clip-grad", "inf"], "clip_grad", float("inf")),
    (["--weight-decay", "0"], "weight_decay", 0.0),
    (["--adam-eps", "1e-30"], "adam_eps", 1e-30),
    (["--adam-beta1", "0"], "adam_beta1", 0.0),
    (["--lr-warmup-fraction", "0"], "lr_warmup_fraction", 0.0),
    (["--lr", "0.1", "--min-lr", "0.1"], "min_lr", 0.1),
    (["--optimizer", "sgd", "--adam-eps", "0"], "adam_eps", 0.0),  # SGD has no epsilon
    (["--optimizer", "sgd", "--sgd-momentum", "0.99"], "sgd_momentum", 0.99),
    (["--sgd-momentum", "1.5"], "sgd_momentum", 1.5),  # Adam does not use it
])
def test_the_limits_are_accepted(flags, name, value):
    assert getattr(parse_args(BASE + flags, world_size=1).optim, name) == value


@pytest.mark.parametrize("flags, section, name", [
    (["--hidden-dropout", "0"], "model", "hidden_dropout"),
    (["--attention-dropout", "0.99"], "model", "attention_dropout"),
    (["--exit-duration-in-mins", "inf"], "training", "exit_duration_in_mins"),
])
def test_other_limits_are_accepted(flags, section, name):
    config = parse_args(BASE + flags, world_size=1)
    assert getattr(getattr(config, section), name) == float(flags[1])
