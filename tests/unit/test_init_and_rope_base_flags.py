"""--init-method-std below 0 crashed building the model (torch's 'normal expects std >= 0.0' traceback);
--rotary-base 0 (or below) with rope trained into NaN at the first step (0 ** negative powers are
inf). Both are one line naming the flag, exit 2, before any work."""

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
