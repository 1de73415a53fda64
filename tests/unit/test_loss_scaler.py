"""The fp16 loss-scale schedule (Megatron-LM's dynamic rule): grow x2 after a window of clean steps, halve after
``hysteresis`` overflowing steps, never below the floor; a static scale never moves."""

import pytest

from megatron_lite.config import PrecisionConfig
from megatron_lite.precision.loss_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler
from tests.cli_errors import parse_refused


def test_defaults_follow_flags():
    s = build_loss_scaler(PrecisionConfig(fp16=True))
    assert isinstance(s, DynamicLossScaler)
    assert (s.scale, s.min_scale, s.growth_interval, s.hysteresis) == (2.0**32, 1.0, 1000, 2)
    assert isinstance(build_loss_scaler(PrecisionConfig(fp16=True, loss_scale=128.0)), ConstantLossScaler)
    assert build_loss_scaler(PrecisionConfig(bf16=True)) is None


def test_static_loss_scale_applies_to_bf16_and_is_refused_in_fp32(capsys):
    """As in Megatron-LM, --loss-scale gives bf16 a constant scale (it was ignored); fp32 has no loss
    scaling, so the flag is refused there instead of being ignored."""
    scaler = build_loss_scaler(PrecisionConfig(bf16=True, loss_scale=1024.0))
    assert isinstance(scaler, ConstantLossScaler) and scaler.scale == 1024.0
    base = ["--mock-data", "--vocab-size", "64", "--loss-scale"]
    parse_refused(capsys, base + ["1024"], "--loss-scale needs --fp16 or --bf16")
    parse_refused(capsys, base + ["-1", "--bf16"], "--loss-scale must be positive")


def test_grows_after_window_of_clean_steps():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=3, hysteresis=2)
    scales = []
    for _ in range(7):
        s.update(False)
        scales.append(s.scale)
    assert scales == [8, 8, 16, 16, 16, 32, 32]
    s.update(True)  # an overflow resets the window
    s.update(False)
    s.update(False)
    assert s.scale == 32
    s.update(False)
    assert s.scale == 64


def test_backs_off_after_hysteresis_and_floors():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, growth_interval=100, hysteresis=2)
    s.update(True)
    assert s.scale == 8  # first overflow is tolerated
    s.update(False)  # clean steps do not refill the hysteresis budget (only growth does)
    s.update(True)
    assert s.scale == 4
    s.update(True)  # budget exhausted: every further overflow halves
    assert s.scale == 2
    s.update(True)
    assert s.scale == 2  # floor


def test_growth_refills_hysteresis():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=2, hysteresis=2)
    s.update(True)
    s.update(False)
    s.update(False)  # grows to 16 and refills the budget
    assert s.scale == 16
    s.update(True)
    assert s.scale == 16
    s.update(True)
    assert s.scale == 8


def test_state_dict_round_trip_and_static():
    a = DynamicLossScaler(initial_scale=8.0, growth_interval=3, hysteresis=3)
    for found in (True, False, False):
        a.update(found)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    b.growth_interval, b.hysteresis = 3, 3
    for found in (False, True, True, True, False):
        a.update(found)
        b.update(found)
        assert a.scale == b.scale
    c = ConstantLossScaler(64.0)
    c.update(True)
    assert c.scale == 64.0
    with pytest.raises(ValueError, match="--loss-scale"):
        ConstantLossScaler(0)


def test_static_and_dynamic_scalers_load_each_others_state():
    """A resume may switch between --loss-scale and dynamic scaling: a static scale is this run's
    flag (the checkpoint's scale is not taken, as in Megatron-LM); a dynamic scaler continues from a
    static checkpoint's scale with a fresh window and hysteresis."""
    dynamic = DynamicLossScaler(initial_scale=2.0**20, hysteresis=2)
    dynamic.update(True)
    dynamic.update(True)
    static = ConstantLossScaler(1024.0)
    static.load_state_dict(dynamic.state_dict())
    assert static.scale == 1024.0
    fresh = DynamicLossScaler(initial_scale=2.0**32, growth_interval=2, hysteresis=2)
    fresh.load_state_dict(ConstantLossScaler(256.0).state_dict())
    assert (fresh.scale, fresh.growth_tracker, fresh.hysteresis_tracker) == (256.0, 0, 2)
    fresh.update(True)
    assert fresh.scale == 256.0  # one overflow of the hysteresis budget of 2
    fresh.update(True)
    assert fresh.scale == 128.0


def test_floor_above_initial_scale_is_refused():
    """A floor above the start would make the first backed-off overflow *raise* the scale to the floor."""
    with pytest.raises(ValueError, match="--min-loss-scale"):
        DynamicLossScaler(initial_scale=8.0, min_scale=16.0)
    build_loss_scaler(PrecisionConfig(fp16=True, loss_scale=4.0, min_loss_scale=16.0))  # static: the floor is unused
