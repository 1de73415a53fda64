"""Flag values below the smallest valid one, each accepted before and then failing at work time:
--vocab-size 0 trained on an empty vocabulary (lm loss 0.0, exit 0) and a negative one raised numpy's
'high <= 0' from the mock dataset; --init-method-std below 0 crashed building the model; --rotary-base
0 with rope and a negative --norm-epsilon trained into NaN at the first step; a negative
--moe-input-jitter-eps crashed the first step; --ffn-hidden-size, --kv-channels, --num-query-groups
(given, not derived) at 0 and --num-workers -1 crashed the first step with a traceback. Each is now
one line naming the flag, exit 2, before any work; the smallest valid values are accepted."""

import pytest

from megatron_lite.arguments import parse_args
from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64"]


@pytest.mark.parametrize("size", ["0", "-5"])
@pytest.mark.parametrize("data", [["--mock-data"], ["--mock-data", "--tokenizer-type", "NullTokenizer"]])
def test_a_vocabulary_below_one_token_is_refused(capsys, size, data):
    parse_refused(capsys, data + ["--vocab-size", size], f"--vocab-size must be at least 1, got {size}", world_size=1)


@pytest.mark.parametrize("flags, words", [
    (["--init-method-std", "-1"], "--init-method-std must be at least 0, got -1.0"),
    (["--position-embedding-type", "rope", "--rotary-base", "0"], "--rotary-base must be positive"),
    (["--position-embedding-type", "rope", "--rotary-base", "-10000"], "--rotary-base must be positive"),
    (["--norm-epsilon", "-1"], "--norm-epsilon must be at least 0, got -1.0"),
    (["--num-experts", "4", "--moe-input-jitter-eps", "-1"], "--moe-input-jitter-eps must be at least 0, got -1.0"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be positive, got 0"),
    (["--ffn-hidden-size", "0", "--swiglu"], "--ffn-hidden-size must be positive, got 0"),
    (["--kv-channels", "0"], "--kv-channels must be positive, got 0"),
    (["--kv-channels", "-8"], "--kv-channels must be positive, got -8"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups must be positive, got 0"),
    (["--num-workers", "-1"], "--num-workers must be at least 0, got -1"),
])
def test_a_value_below_the_smallest_is_refused(capsys, flags, words):
    parse_refused(capsys, BASE + flags, words, world_size=1)


def test_the_smallest_values_are_accepted():
    assert parse_args(["--mock-data", "--vocab-size", "1"], world_size=1).model.vocab_size == 1
    parse_args(BASE + ["--init-method-std", "0", "--position-embedding-type", "rope", "--rotary-base", "500"],
               world_size=1)
    parse_args(BASE + ["--rotary-base", "0"], world_size=1)  # learned positions: no rotary embedding to break
    config = parse_args(BASE + ["--ffn-hidden-size", "1", "--kv-channels", "1", "--group-query-attention",
                                "--num-query-groups", "1", "--num-workers", "0"], world_size=1)
    m = config.model
    assert (m.ffn_hidden_size, m.kv_channels, m.num_query_groups, config.data.num_workers) == (1, 1, 1, 0)
