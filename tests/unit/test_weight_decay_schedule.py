"""--start-weight-decay / --end-weight-decay / --weight-decay-incr-style: the decay set on the decaying
param group at every step equals Megatron-LM's formula (exact to 1e-12), the other groups keep 0, the
schedule resumes exactly from a state dict and a changed one is refused unless told which to follow;
bad combinations are one-line exit-2 errors naming the flag."""

import math

import pytest
import torch

from megatron_lite.config import OptimizerConfig
from megatron_lite.errors import ConfigError
from megatron_lite.optim.lr_scheduler import OptimizerParamScheduler
from tests.cli_errors import parse_refused

N, START, END = 40, 0.01, 0.1


def _sched(style="linear", start=START, end=END, train_iters=N, train_samples=None, gbs=1, **kw):
    decay, no_decay = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [decay], "weight_decay": 0.5}, {"params": [no_decay], "weight_decay": 0.0}])
    opt.decay_groups = [True, False]  # as MegatronOptimizer marks them
    if style == "constant":
        start = end = None
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.5, weight_decay_incr_style=style, start_weight_decay=start,
                          end_weight_decay=end, **kw)
    return opt, OptimizerParamScheduler(opt, cfg, train_iters=train_iters, train_samples=train_samples,
                                        global_batch_size=gbs)


def _expected(style, n, steps=N):
    if style == "constant":
        return 0.5
    if n > steps:
        return END
    ratio = n / steps
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1)
    return START + coeff * (END - START)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_weight_decay_matches_formula_at_every_step(style):
    opt, sched = _sched(style)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(_expected(style, 0), rel=1e-12)
    for n in range(1, N + 5):
        sched.step()
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(_expected(style, n), rel=1e-12), n
        assert opt.param_groups[1]["weight_decay"] == 0.0  # biases and norms never decay
    if style != "constant":  # the key points: start, half-way, end
        assert _expected(style, 0) == START and _expected(style, N) == pytest.approx(END)
        assert _expected("cosine", N // 2) == pytest.approx((START + END) / 2)


def test_samples_schedule_counts_samples():
    opt, sched = _sched("linear", train_iters=None, train_samples=N * 4, gbs=4)
    for n in range(1, 12):
        sched.step()
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(_expected("linear", n), rel=1e-12), n


def test_without_decay_groups_the_groups_that_decay_are_taken_from_their_initial_decay():
    opt, _ = _sched("linear")
    del opt.decay_groups
    sched = OptimizerParamScheduler(opt, OptimizerConfig(weight_decay_incr_style="linear", start_weight_decay=START,
                                                         end_weight_decay=END), train_iters=N)
    sched.step(N)
    assert [g["weight_decay"] for g in opt.param_groups] == [pytest.approx(END), 0.0]


def test_state_dict_resumes_exactly():
    opt_a, a = _sched("cosine")
    a.step(13)
    opt_b, b = _sched("cosine")
    b.load_state_dict(a.state_dict())
    assert opt_b.param_groups[0]["weight_decay"] == opt_a.param_groups[0]["weight_decay"]
    for _ in range(N):
        a.step()
        b.step()
        assert opt_b.param_groups[0]["weight_decay"] == opt_a.param_groups[0]["weight_decay"]


@pytest.mark.parametrize("change,flag", [(dict(end=0.2), "--end-weight-decay 0.2 in this run, 0.1"),
                                         (dict(start=0.0), "--start-weight-decay 0.0 in this run, 0.01"),
                                         (dict(style="cosine"), "--weight-decay-incr-style cosine in this run"),
                                         (dict(style="constant"), "--weight-decay-incr-style constant in this run"),
                                         (dict(train_iters=80, lr_decay_iters=N), "--train-iters 80 in this run")])
def test_a_changed_schedule_is_refused_unless_told_which(change, flag):
    _, saved = _sched("linear")
    saved.step(7)
    sd = saved.state_dict()
    with pytest.raises(ConfigError, match=flag):
        _sched(**{"style": "linear", **change})[1].load_state_dict(sd)
    opt, ours = _sched(**{"style": "linear", **change}, override_opt_param_scheduler=True)
    ours.load_state_dict(sd)
    assert ours.num_steps == 7 and opt.param_groups[0]["weight_decay"] == ours.get_wd()
    opt, theirs = _sched(**{"style": "linear", **change}, use_checkpoint_opt_param_scheduler=True)
    theirs.load_state_dict(sd)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(_expected("linear", 7), rel=1e-12)


def test_a_checkpoint_without_a_weight_decay_schedule_loads_under_constant_decay():
    _, saved = _sched("constant")
    sd = {k: v for k, v in saved.state_dict().items() if "wd" not in k}  # saved before the schedule existed
    opt, sched = _sched("constant")
    sched.load_state_dict(sd)
    assert opt.param_groups[0]["weight_decay"] == 0.5


@pytest.mark.parametrize("argv,words", [
    (["--start-weight-decay", "0.01", "--end-weight-decay", "0.1"], ["--weight-decay-incr-style linear or cosine"]),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.01"],
     ["--weight-decay-incr-style linear needs both --start-weight-decay and --end-weight-decay"]),
    (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.2", "--end-weight-decay", "0.1"],
     ["0 <= --start-weight-decay <= --end-weight-decay", "0.2"]),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "-0.1", "--end-weight-decay", "0.1"],
     ["0 <= --start-weight-decay"]),
    (["--weight-decay-incr-style", "exponential"], ["--weight-decay-incr-style", "invalid choice"]),
])
def test_bad_flags_exit_2_with_one_line(capsys, argv, words):
    parse_refused(capsys, ["--mock-data", "--vocab-size", "64"] + argv, *words, world_size=1)
