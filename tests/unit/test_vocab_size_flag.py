"""--vocab-size below 1: with --mock-data, 0 trained a model on an empty vocabulary with lm loss 0.0
and exit 0, and a negative size raised numpy's 'ValueError: high <= 0' from the mock dataset during
training. Both are one line naming the flag, exit 2, before any work; 1 is the smallest vocabulary."""

import pytest

from megatron_lite.arguments import parse_args
from tests.cli_errors import parse_refused


@pytest.mark.parametrize("size", ["0", "-5"])
@pytest.mark.parametrize("data", [["--mock-data"], ["--mock-data", "--tokenizer-type", "NullTokenizer"]])
def test_a_vocabulary_below_one_token_is_refused(capsys, size, data):
    parse_refused(capsys, data + ["--vocab-size", size], f"--vocab-size must be at least 1, got {size}", world_size=1)


def test_one_token_is_accepted():
    assert parse_args(["--mock-data", "--vocab-size", "1"], world_size=1).model.vocab_size == 1
