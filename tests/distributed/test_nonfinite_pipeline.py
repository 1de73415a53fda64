"""--check-for-nan-in-loss-and-grad with pipeline stages: only the last stage holds the loss, so a
step the fp16 loss scaler skipped (no gradient norm) asks the whole pipeline; every stage stops."""

import pytest

from tests.harness import cached_state, run_ranks


def _check(loss_on_last_stage, grad_norm):
    from megatron_lite.config import Config
    from megatron_lite.training.nonfinite import NonFiniteError, check_finite

    state = cached_state(pp=2)
    loss = loss_on_last_stage if state.is_last_stage() else None
    try:
        check_finite(Config(), state, 3, loss, grad_norm)
    except NonFiniteError as err:
        return str(err)
    return None


def test_a_nan_loss_in_a_skipped_fp16_step_stops_every_stage():
    first, last = run_ranks(2, _check, float("nan"), None)
    assert first.startswith("iteration 3, rank 0: loss not finite on the last pipeline stage"), first
    assert last.startswith("iteration 3, rank 1: loss nan"), last


@pytest.mark.parametrize("loss, grad_norm", [(2.5, None), (2.5, 1.0)])
def test_a_finite_loss_trains_on(loss, grad_norm):
    assert run_ranks(2, _check, loss, grad_norm) == [None, None]


def test_a_finite_gradient_norm_asks_no_stage():
    """A finite norm shows a sound step (a NaN loss makes NaN gradients): no collective is needed."""
    assert run_ranks(2, _check, float("nan"), 1.0) == [None, None]
