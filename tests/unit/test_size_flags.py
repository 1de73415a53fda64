"""Sizes that can be given or derived (--ffn-hidden-size, --kv-channels, --num-query-groups) and
--num-workers: a value below the smallest valid one was accepted and crashed on the first step with a
traceback (RuntimeError 'cannot reshape tensor of 0 elements', ZeroDivisionError, torch's ValueError
'num_workers option should be non-negative'). Each is one line naming the flag, exit 2."""

import pytest

from megatron_lite.arguments import parse_args
from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64"]


@pytest.mark.parametrize("flags, words", [
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be positive, got 0"),
    (["--ffn-hidden-size", "0", "--swiglu"], "--ffn-hidden-size must be positive, got 0"),
    (["--kv-channels", "0"], "--kv-channels must be positive, got 0"),
    (["--kv-channels", "-8"], "--kv-channels must be positive, got -8"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups must be positive, got 0"),
    (["--num-workers", "-1"], "--num-workers must be at least 0, got -1"),
])
def test_a_size_below_the_smallest_is_refused(capsys, flags, words):
    parse_refused(capsys, BASE + flags, words, world_size=1)


def test_the_smallest_sizes_are_accepted():
    config = parse_args(BASE + ["--ffn-hidden-size", "1", "--kv-channels", "1", "--group-query-attention",
                                "--num-query-groups", "1", "--num-workers", "0"], world_size=1)
    m = config.model
    assert (m.ffn_hidden_size, m.kv_channels, m.num_query_groups, config.data.num_workers) == (1, 1, 1, 0)
