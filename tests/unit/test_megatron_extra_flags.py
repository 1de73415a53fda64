"""Megatron-LM flags added later: --sgd-momentum reaches torch.optim.SGD (it was fixed at 0.9);
a negative one is refused in one line (exit 2) instead of torch's ValueError traceback."""

import pytest
from torch import nn

from megatron_lite.arguments import parse_args
from megatron_lite.optim import MegatronOptimizer
from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64"]


@pytest.mark.parametrize("flags, momentum", [([], 0.9), (["--sgd-momentum", "0.5"], 0.5),
                                             (["--sgd-momentum", "0"], 0.0)])
def test_sgd_momentum_reaches_torch(flags, momentum):
    config = parse_args(BASE + ["--optimizer", "sgd"] + flags)
    assert config.optim.sgd_momentum == momentum
    opt = MegatronOptimizer([nn.Linear(3, 2)], None, config.optim)
    assert [g["momentum"] for g in opt.param_groups] == [momentum, momentum]


def test_negative_sgd_momentum_is_one_line_exit_2(capsys):
    parse_refused(capsys, BASE + ["--optimizer", "sgd", "--sgd-momentum=-0.1"], "--sgd-momentum must be at least 0, got -0.1")
