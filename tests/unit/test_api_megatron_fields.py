"""PUT /api's request checks (parse_api) that need no model: each bad body is one RequestError
(HTTP 400) naming the field, never another exception (HTTP 500)."""

import pytest

from megatron_lite.data.tokenizers import NullTokenizer
from megatron_lite.inference.api_megatron import parse_api
from megatron_lite.inference.fields import RequestError


@pytest.mark.parametrize("value", [None, "2", 2.0, True])
def test_a_beam_width_that_is_not_an_integer_is_a_bad_request(value):
    with pytest.raises(RequestError, match=r"^beam_width must be an integer, got "):
        parse_api({"prompts": ["1 2"], "beam_width": value}, NullTokenizer(99))


def test_a_beam_width_runs_beam_search():
    job = parse_api({"prompts": ["1 2"], "beam_width": 3, "tokens_to_generate": 4}, NullTokenizer(99))
    assert job.beam and job.params.beam_width == 3
