"""--calculate-per-token-loss pieces in one process: the reduction of reported [sum, count] pairs,
validation over all its iterations, the auxiliary-loss factor, GPT's loss_func with multi-token
prediction, and BERT's refusal. The training runs (SFT data, PP2 / CP2 / ZeRO-2 against one
process, the hand-computed first step) are in tests/e2e/test_sft.py."""

from types import SimpleNamespace

import pytest
import torch

import pretrain_gpt
from megatron_lite.arguments import parse_args
from megatron_lite.training.per_token_loss import aux_loss_scale, reduce_reported
from megatron_lite.training.step import evaluate
from tests.cli_errors import refused_line

STATE = SimpleNamespace(pp_size=1, pp_rank=0, vpp_size=None, dp_group=None, dp_cp_group=None, dp_size=1, cp_size=1)
# (sum of token losses, loss tokens) of six micro-batches: three evaluation iterations of two
BATCHES = [(6.0, 2.0), (30.0, 10.0), (1.0, 1.0), (8.0, 2.0), (0.0, 0.0), (12.0, 3.0)]


def _config(*flags):
    return parse_args(["--mock-data", "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "2",
                       "--eval-iters", "3", *flags], world_size=1)


def _forward_step(per_token, data_iterator, model):
    total, count = next(data_iterator)
    output = torch.tensor(total)
    if per_token:
        return output, lambda out: (out, torch.tensor(count), {"lm loss": torch.stack([out, torch.tensor(count)])})
    return output, lambda out: (out / max(count, 1), {"lm loss": out / max(count, 1)})


@pytest.mark.parametrize("per_token", [True, False])
def test_validation_divides_all_its_token_losses_by_all_its_tokens(per_token):
    config = _config(*(["--calculate-per-token-loss"] if per_token else []))
    got = evaluate(config, SimpleNamespace(state=STATE), [torch.nn.Linear(1, 1)],
                   lambda it, model: _forward_step(per_token, it, model), iter(BATCHES))
    if per_token:
        expected = sum(s for s, _ in BATCHES) / sum(c for _, c in BATCHES)  # 57 / 18
    else:  # mean over the iterations of the mean of the micro-batch means
        expected = sum(s / max(c, 1) for s, c in BATCHES) / len(BATCHES)
    assert got["lm loss"] == pytest.approx(expected, rel=1e-12)


def test_reported_pairs_are_summed_before_dividing():
    reported = [{"lm loss": torch.tensor([s, c]), "mtp_1 loss": torch.tensor([2 * s, c])} for s, c in BATCHES[:4]]
    got = reduce_reported(reported, STATE)
    assert got == pytest.approx({"lm loss": 45.0 / 15.0, "mtp_1 loss": 90.0 / 15.0}, rel=1e-12)
    assert reduce_reported([{"lm loss": torch.tensor([0.0, 0.0])}], STATE) == {"lm loss": 0.0}  # no loss tokens


def test_auxiliary_losses_get_the_loss_scale_alone_per_token():
    """Megatron-LM: per token the routers' losses are not divided by the micro-batches (the step
    divides every gradient by the global token count instead)."""
    state = SimpleNamespace(cp_size=2)
    assert aux_loss_scale(_config("--calculate-per-token-loss"), state, 512.0, 8) == 512.0
    assert aux_loss_scale(_config(), state, 512.0, 8) == 512.0 * 2 / 8


def test_gpt_loss_func_returns_sums_counts_and_pairs_with_mtp():
    losses = torch.arange(3 * 3 * 4, dtype=torch.float32).reshape(3, 3, 4)  # [1 + D, b, s] with D = 2
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    mtp_mask = torch.tensor([[[1.0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], [[0.0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]])
    loss, count, reported = pretrain_gpt.loss_func(mask, losses, mtp_loss_mask=mtp_mask, mtp_loss_scaling_factor=0.5,
                                                   per_token=True)
    lm_sum = float((losses[0] * mask).sum())
    mtp_sums = [float((losses[k] * mtp_mask[k - 1]).sum()) for k in (1, 2)]
    assert float(count) == 7.0
    assert float(loss) == pytest.approx(lm_sum + 0.5 / 2 * sum(mtp_sums))  # Megatron: factor / D x the depths' sums
    assert reported["lm loss"].tolist() == [lm_sum, 7.0]
    assert reported["mtp_1 loss"].tolist() == [mtp_sums[0], 3.0]
    assert reported["mtp_2 loss"].tolist() == [mtp_sums[1], 1.0]


def test_pretrain_bert_refuses_the_flag(capsys, monkeypatch):
    import pretrain_bert

    monkeypatch.setenv("MEGATRON_LITE_CHECK_ARGS", "1")
    refused_line(capsys, lambda: pretrain_bert.main(["--mock-data", "--vocab-size", "64", "--calculate-per-token-loss"]),
                 "--calculate-per-token-loss is GPT-only")
