"""The server's streamed answers read by OpenAI's own Python client (skipped without it):
``stream_options.include_usage`` ends the stream with a chunk of no choices carrying the usage, as
OpenAI's API does, equal to the non-streamed answer's."""

import pytest

from tests.inference_helpers import openai_client, served_gpt

pytest.importorskip("flask")


@pytest.fixture(scope="module")
def api():
    return openai_client(served_gpt()[0].application)[1]


def test_include_usage_ends_a_streamed_completion_with_its_usage(api):
    request = {"model": "megatron_lite", "prompt": ["1 2", "3 4 5"], "max_tokens": 5, "temperature": 0, "n": 2}
    want = api.completions.create(**request)
    chunks = list(api.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == want.usage
    assert all(c.usage is None and c.choices for c in chunks[:-1])
    texts = {}
    for c in chunks[:-1]:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert texts == {c.index: c.text for c in want.choices}
    assert list(api.completions.create(**request, stream=True))[-1].usage is None  # only when asked


def test_include_usage_ends_a_streamed_chat_with_its_usage(api):
    request = {"model": "megatron_lite", "messages": [{"role": "user", "content": "5 17"}], "max_tokens": 6,
               "temperature": 0}
    want = api.chat.completions.create(**request)
    chunks = list(api.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == want.usage
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want.choices[0].message.content
