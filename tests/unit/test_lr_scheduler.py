"""OptimizerParamScheduler against the closed-form formulas, step by step (exact to 1e-12)."""

import math

import pytest
import torch

from megatron_lite.config import OptimizerConfig
from megatron_lite.optim.lr_scheduler import OptimizerParamScheduler

LR, MIN_LR, W, D, DW = 1e-3, 1e-5, 10, 100, 20


def _sched(style, **kw):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=123.0)
    cfg = OptimizerConfig(lr=LR, min_lr=MIN_LR, lr_decay_style=style, lr_warmup_iters=W, lr_decay_iters=D,
                          lr_wsd_decay_iters=DW, **kw)
    return opt, OptimizerParamScheduler(opt, cfg, train_iters=1000)


def _expected(style, n, wsd_style="exponential"):
    if n <= W:
        return LR * n / W
    if style == "constant":
        return LR
    if style == "inverse-square-root":  # D plays no part: past it the decay goes on
        return max(MIN_LR, LR * math.sqrt(W / n))
    if n > D:
        return MIN_LR
    if style == "WSD":
        start = D - DW
        if n <= start:
            return LR
        q = (n - start) / DW
        coeff = {"linear": 1 - q, "cosine": 0.5 * (1 + math.cos(math.pi * q)), "exponential": 2 * 0.5**q - 1,
                 "minus_sqrt": 1 - math.sqrt(q)}[wsd_style]
        return MIN_LR + coeff * (LR - MIN_LR)
    r = (n - W) / (D - W)
    coeff = 1 - r if style == "linear" else 0.5 * (1 + math.cos(math.pi * r))
    return MIN_LR + coeff * (LR - MIN_LR)


@pytest.mark.parametrize(
    "style, wsd_style",
    [("constant", None), ("linear", None), ("cosine", None), ("WSD", "exponential"), ("WSD", "linear"), ("WSD", "cosine"),
     ("WSD", "minus_sqrt"), ("inverse-square-root", None)],
)
def test_schedule_matches_formula_at_every_step(style, wsd_style):
    opt, sched = _sched(style, **({"lr_wsd_decay_style": wsd_style} if wsd_style else {}))
    assert opt.param_groups[0]["lr"] == 0.0  # warmup starts from 0
    for n in range(1, 130):
        sched.step()
        want = _expected(style, n, wsd_style)
        assert sched.get_lr() == pytest.approx(want, rel=1e-12, abs=1e-15), n
        assert all(g["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15) for g in opt.param_groups)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_warmup_fraction_is_that_fraction_of_the_decay(style):
    """--lr-warmup-fraction F warms up over F x --lr-decay-iters: 0.1 of 100 is the formula's 10 steps.
    (test_train_samples compares the fraction in iterations with the fraction in samples, which a
    fraction ignored in both modes would pass.)"""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    cfg = OptimizerConfig(lr=LR, min_lr=MIN_LR, lr_decay_style=style, lr_warmup_fraction=W / D, lr_decay_iters=D)
    sched = OptimizerParamScheduler(opt, cfg, train_iters=1000)
    for n in range(1, 110):
        sched.step()
        assert sched.get_lr() == pytest.approx(_expected(style, n), rel=1e-12, abs=1e-15), n


def test_key_points():
    _, cos = _sched("cosine")
    cos.step(W)
    assert cos.get_lr() == pytest.approx(LR)  # end of warmup: peak
    cos.step((D - W) // 2)
    assert cos.get_lr() == pytest.approx((LR + MIN_LR) / 2)  # half-way through cosine decay
    cos.step((D - W) // 2)
    assert cos.get_lr() == pytest.approx(MIN_LR)
    _, wsd = _sched("WSD")
    wsd.step(D - DW)
    assert wsd.get_lr() == pytest.approx(LR)  # stable phase lasts until the final decay
    wsd.step(DW)
    assert wsd.get_lr() == pytest.approx(MIN_LR)  # exponential: 2 * 0.5 - 1 = 0


def test_state_dict_round_trip():
    _, a = _sched("cosine")
    a.step(37)
    opt, b = _sched("cosine")
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 37 and b.get_lr() == a.get_lr() and opt.param_groups[0]["lr"] == a.get_lr()
    a.step()
    b.step()
    assert a.get_lr() == b.get_lr()


def test_bad_flags_are_clear_errors():
    with pytest.raises(ValueError, match="lr-wsd-decay-iters"):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        OptimizerParamScheduler(opt, OptimizerConfig(lr_decay_style="WSD", lr_wsd_decay_iters=None), 100)
    with pytest.raises(ValueError, match="lr-decay-iters 5 must exceed --lr-warmup-iters 10"):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        OptimizerParamScheduler(opt, OptimizerConfig(lr_decay_style="linear", lr_warmup_iters=10, lr_decay_iters=5), 100)



def test_wsd_warmup_that_hides_the_decay_is_refused(capsys):
    """WSD with a warmup as long as the decay never anneals (the run ended mid-warmup, at lr * 5 / 10,
    not --min-lr); refused as for linear and cosine (Megatron-LM refuses it for every style)."""
    from tests.cli_errors import parse_refused

    with pytest.raises(ValueError, match="lr-decay-iters 5 must exceed --lr-warmup-iters 10"):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        OptimizerParamScheduler(opt, OptimizerConfig(lr_decay_style="WSD", lr_warmup_iters=10, lr_decay_iters=5,
                                                     lr_wsd_decay_iters=2), 100)
    parse_refused(capsys, ["--mock-data", "--vocab-size", "64", "--train-iters", "5", "--lr-decay-style", "WSD",
                           "--lr-wsd-decay-iters", "2", "--lr-warmup-iters", "10"],
                  "--lr-decay-iters 5 (default --train-iters) must exceed --lr-warmup-iters 10 for --lr-decay-style WSD")


def _resumed(saved_decay, **flags):
    """A schedule decaying over 200 steps loading one saved at step 50 that decayed over ``saved_decay``."""
    def schedule(decay, **kw):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return OptimizerParamScheduler(opt, OptimizerConfig(lr=LR, min_lr=MIN_LR, lr_decay_style="linear",
                                                            lr_warmup_iters=W, lr_decay_iters=decay, **kw), 1000)

    before = schedule(saved_decay)
    before.step(50)
    after = schedule(200, **flags)
    after.load_state_dict(before.state_dict())
    return after


def test_a_changed_schedule_is_refused_on_resume_unless_told_which():
    """As Megatron-LM: a checkpoint's schedule that differs from the flags (here the decay end, as a
    larger --train-iters moves it) is refused; --override-opt_param-scheduler keeps the flags',
    --use-checkpoint-opt_param-scheduler the checkpoint's."""
    from megatron_lite.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--lr-decay-iters \(default --train-iters\) 200 in this run, 100 in the "
                                          r"checkpoint; pass --override-opt_param-scheduler .* or "
                                          r"--use-checkpoint-opt_param-scheduler"):
        _resumed(D)
    ours = _resumed(D, override_opt_param_scheduler=True)
    assert ours.num_steps == 50 and ours.decay_steps == 200
    assert ours.get_lr() == pytest.approx(MIN_LR + (LR - MIN_LR) * (1 - 40 / 190))
    theirs = _resumed(D, use_checkpoint_opt_param_scheduler=True)
    assert theirs.num_steps == 50 and theirs.decay_steps == D
    assert theirs.get_lr() == pytest.approx(_expected("linear", 50))
    assert _resumed(200).decay_steps == 200  # the same schedule loads without either flag


def test_the_last_warmup_step_is_the_peak_even_when_the_wsd_anneal_started_earlier():
    # n <= W is warmup (Megatron's rule): at n = W the lr is the peak, whatever the decay phase would
    # give there. Only a WSD anneal that starts before the warmup ends tells n <= W from n < W.
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    cfg = OptimizerConfig(lr=LR, min_lr=MIN_LR, lr_decay_style="WSD", lr_warmup_iters=10, lr_decay_iters=20,
                          lr_wsd_decay_iters=15, lr_wsd_decay_style="linear")
    sched = OptimizerParamScheduler(opt, cfg, train_iters=20)
    sched.step(10)
    assert sched.get_lr() == pytest.approx(LR, rel=1e-12)
    sched.step()
    assert sched.get_lr() == pytest.approx(MIN_LR + (1 - 6 / 15) * (LR - MIN_LR), rel=1e-12)


def test_inverse_square_root_megatron_choices():
    """Megatron-LM's --lr-decay-style inverse-square-root and --lr-wsd-decay-style minus_sqrt were refused
    as not built: the peak at the end of warmup, 1/sqrt(steps) after it (lr/2 at 4 W, min-lr as a floor,
    no warmup counts as 1 step); WSD's minus_sqrt is 1 - sqrt(q) over its decay. The flags parse, and an
    inverse-square-root run needs no --lr-decay-iters above the warmup."""
    from megatron_lite.arguments import parse_args

    _, inv = _sched("inverse-square-root")
    inv.step(4 * W)
    assert inv.get_lr() == pytest.approx(LR / 2)
    inv.step(10**6)
    assert inv.get_lr() == MIN_LR
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cfg = OptimizerConfig(lr=LR, min_lr=0.0, lr_decay_style="inverse-square-root", lr_warmup_iters=0, lr_decay_iters=0)
    sched = OptimizerParamScheduler(opt, cfg, train_iters=1000)
    assert sched.get_lr() == LR and sched.step(8) == pytest.approx(LR / math.sqrt(8))
    _, wsd = _sched("WSD", lr_wsd_decay_style="minus_sqrt")
    wsd.step(D - DW + DW // 4)
    assert wsd.get_lr() == pytest.approx(MIN_LR + 0.5 * (LR - MIN_LR))
    tiny = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "10"]
    config = parse_args(tiny + ["--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "10"], world_size=1)
    assert config.optim.lr_decay_style == "inverse-square-root"
    config = parse_args(tiny + ["--lr-decay-style", "WSD", "--lr-wsd-decay-style", "minus_sqrt", "--lr-wsd-decay-iters", "5"],
                        world_size=1)
    assert config.optim.lr_wsd_decay_style == "minus_sqrt"


def test_lr_warmup_init_is_where_the_warmup_starts():
    """--lr-warmup-init I: warmup lr = I + (lr - I) * n / W (Megatron-LM's formula), the decay after it
    unchanged; the decoupled group warms up from I too; a checkpoint keeps I, and one saved with another
    I is refused on resume as the other schedule flags are."""
    from megatron_lite.errors import ConfigError

    init = 2e-4
    opt, s = _sched("cosine", lr_warmup_init=init)
    for n in (0, 1, 3, W):
        s.num_steps = n
        assert s.get_lr() == pytest.approx(init + (LR - init) * n / W, rel=1e-12, abs=0)
    for n in (W + 1, 50, D + 5):
        s.num_steps = n
        assert s.get_lr() == pytest.approx(_expected("cosine", n), rel=1e-12, abs=1e-15)
    s.num_steps = 0
    s.decoupled_lr, s.decoupled_min_lr = 5e-3, 0.0
    s.num_steps = 4
    assert s.get_lr(decoupled=True) == pytest.approx(init + (5e-3 - init) * 4 / W)
    _, a = _sched("cosine", lr_warmup_init=init)
    a.step(3)
    opt, b = _sched("cosine", lr_warmup_init=init)
    b.load_state_dict(a.state_dict())
    assert b.get_lr() == a.get_lr() == opt.param_groups[0]["lr"] == pytest.approx(init + (LR - init) * 3 / W)
    _, c = _sched("cosine")
    with pytest.raises(ConfigError, match="--lr-warmup-init 0.0 in this run, 0.0002 in the checkpoint"):
        c.load_state_dict(a.state_dict())
