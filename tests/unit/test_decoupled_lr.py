"""--decoupled-lr / --decoupled-min-lr: the embedding and output layer's groups follow the learning-rate
schedule between their own peak and floor (default --min-lr) at every step, the other groups keep
--lr's; the groups split exactly the marked weights and translate to and from the saved two-group
layout; bad values are one-line exit-2 errors naming the flag."""

import math

import pytest
import torch

from megatron_lite.config import ModelConfig, OptimizerConfig
from megatron_lite.errors import ConfigError
from megatron_lite.optim.lr_scheduler import OptimizerParamScheduler
from megatron_lite.optim.param_groups import build_groups, from_saved_layout, to_saved_layout
from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused
from tests.model_helpers import build_gpt

LR, MIN_LR, DLR, W, D = 1e-3, 1e-5, 4e-3, 5, 30


def _cosine(n, peak, floor):
    if n <= W:
        return peak * n / W
    if n > D:
        return floor
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (n - W) / (D - W)))


@pytest.mark.parametrize("decoupled_min_lr,floor", [(None, MIN_LR), (2e-4, 2e-4)])
def test_decoupled_groups_follow_their_own_peak_and_floor(decoupled_min_lr, floor):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    opt = torch.optim.SGD([{"params": [p]} for p in params], lr=1.0)
    opt.decoupled_groups = [False, True, False]
    cfg = OptimizerConfig(lr=LR, min_lr=MIN_LR, lr_decay_style="cosine", lr_warmup_iters=W, lr_decay_iters=D,
                          decoupled_lr=DLR, decoupled_min_lr=decoupled_min_lr)
    sched = OptimizerParamScheduler(opt, cfg, train_iters=40)
    for n in range(1, 40):
        sched.step()
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs[0] == lrs[2] == pytest.approx(_cosine(n, LR, MIN_LR), rel=1e-12), n
        assert lrs[1] == pytest.approx(_cosine(n, DLR, floor), rel=1e-12), n


def test_groups_split_exactly_the_embedding_and_output_weights_and_round_trip_the_saved_layout():
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32,
                      untie_embeddings_and_output_weights=True)
    model = build_gpt(cfg, ParallelState())
    pairs = [(p, p) for p in model.parameters()]
    names = {id(p): n for n, p in model.named_parameters()}
    plain, plain_layout = build_groups(pairs, OptimizerConfig())
    groups, layout = build_groups(pairs, OptimizerConfig(decoupled_lr=1e-2))
    assert layout.flags == [(True, False), (True, True), (False, False)]
    assert [names[id(p)] for p in groups[1]["params"]] == ["embedding.word_embeddings.weight", "output_layer.weight"]
    assert not plain_layout.regrouped and len(plain) == 2
    # one AdamW step on each grouping with the same lr: the saved layouts are the same state dict
    opts = [torch.optim.AdamW([dict(g, params=[p.detach().clone().requires_grad_() for p in g["params"]])
                               for g in gs], lr=1e-2) for gs in (plain, groups)]
    for opt in opts:
        for p in (q for g in opt.param_groups for q in g["params"]):
            p.grad = torch.ones_like(p) * (1 + p.numel() % 7)  # differs between params of different sizes
        opt.step()
    saved = to_saved_layout(opts[1].state_dict(), layout)
    want = opts[0].state_dict()
    assert [len(g["params"]) for g in saved["param_groups"]] == [len(g["params"]) for g in want["param_groups"]]
    for k, v in want["state"].items():
        torch.testing.assert_close(saved["state"][k]["exp_avg"], v["exp_avg"], rtol=0, atol=0)
    back = from_saved_layout(saved, layout)
    assert [len(g["params"]) for g in back["param_groups"]] == [len(g["params"]) for g in groups]
    for k, v in opts[1].state_dict()["state"].items():
        torch.testing.assert_close(back["state"][k]["exp_avg_sq"], v["exp_avg_sq"], rtol=0, atol=0)


@pytest.mark.parametrize("argv,words", [
    (["--decoupled-min-lr", "1e-5"], ["--decoupled-min-lr needs --decoupled-lr"]),
    (["--decoupled-lr", "-1"], ["--decoupled-lr must be at least 0"]),
    (["--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-2"], ["--decoupled-min-lr 0.01 must be in [0, --decoupled-lr"]),
    (["--decoupled-lr", "1e-5", "--min-lr", "1e-4", "--lr", "1e-3"], ["--min-lr 0.0001 must be in [0, --decoupled-lr",
                                                                      "set --decoupled-min-lr"]),
])
def test_bad_values_exit_2_with_one_line(capsys, argv, words):
    parse_refused(capsys, ["--mock-data", "--vocab-size", "64"] + argv, *words, world_size=1)


def test_the_checkpoints_decoupled_lr_is_not_dropped_by_use_checkpoint_opt_param_scheduler():
    """A run without --decoupled-lr has no decoupled group: --use-checkpoint-opt_param-scheduler on a
    checkpoint saved with it used to continue silently with --lr for the embedding and output layer."""
    def sched(decoupled_lr, use_checkpoint=False):
        opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(2)], lr=1.0)
        opt.decoupled_groups = [False, decoupled_lr is not None]
        cfg = OptimizerConfig(lr=LR, min_lr=MIN_LR, lr_decay_style="cosine", lr_warmup_iters=W, lr_decay_iters=D,
                              decoupled_lr=decoupled_lr, use_checkpoint_opt_param_scheduler=use_checkpoint)
        return OptimizerParamScheduler(opt, cfg, train_iters=40), opt

    saved, _ = sched(DLR)
    for _ in range(10):
        saved.step()
    with pytest.raises(ConfigError, match="--decoupled-lr 0.004 .*add those flags") as err:
        sched(None, use_checkpoint=True)[0].load_state_dict(saved.state_dict())
    assert "\n" not in str(err.value)
    resumed, opt = sched(DLR, use_checkpoint=True)
    resumed.load_state_dict(saved.state_dict())
    assert opt.param_groups[1]["lr"] == saved.optimizer.param_groups[1]["lr"] != opt.param_groups[0]["lr"]
    plain, opt = sched(DLR, use_checkpoint=True)
    plain.load_state_dict(sched(None)[0].state_dict())  # the checkpoint's schedule has none: every group takes --lr
    assert opt.param_groups[1]["lr"] == opt.param_groups[0]["lr"]
