"""--init-method-std below 0 crashed building the model (torch's 'normal expects std >= 0.0' traceback),
--moe-input-jitter-eps below 0 crashed the first step; --rotary-base 0 (or below) with rope and a
negative --norm-epsilon trained into NaN at the first step. Each is one line naming the flag, exit 2,
before any work."""

import pytest

from megatron_lite.arguments import parse_args
from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64"]


@pytest.mark.parametrize("flags, words", [
    (["--init-method-std", "-1"], "--init-method-std must be at least 0, got -1.0"),
    (["--position-embedding-type", "rope", "--rotary-base", "0"], "--rotary-base must be positive"),
    (["--position-embedding-type", "rope", "--rotary-base", "-10000"], "--rotary-base must be positive"),
])
def test_refused(capsys, flags, words):
    parse_refused(capsys, BASE + flags, words, world_size=1)


def test_accepted():
    parse_args(BASE + ["--init-method-std", "0", "--position-embedding-type", "rope", "--rotary-base", "500"],
               world_size=1)
    parse_args(BASE + ["--rotary-base", "0"], world_size=1)  # learned positions: no rotary embedding to break


@pytest.mark.parametrize("flags, words", [
    (["--norm-epsilon", "-1"], "--norm-epsilon must be at least 0, got -1.0"),  # NaN loss at the first step
    (["--num-experts", "4", "--moe-input-jitter-eps", "-1"],  # torch's 'uniform_ expects ... from=2 > to=0'
     "--moe-input-jitter-eps must be at least 0, got -1.0"),
])
def test_negative_epsilons_are_refused(capsys, flags, words):
    parse_refused(capsys, BASE + flags, words, world_size=1)
