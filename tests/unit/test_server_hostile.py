"""What real clients send that is not a request the fields can judge (Flask's test client, and a
real socket where the connection itself misbehaves): each gets a 400 naming the problem, never a
500 with a traceback nor a server that stops answering."""

import pytest

from tests.inference_helpers import served_gpt

pytest.importorskip("flask")


@pytest.fixture(scope="module")
def client():
    return served_gpt()[0]


@pytest.mark.parametrize("path, method", [("/v1/completions", "post"), ("/v1/chat/completions", "post"),
                                          ("/api", "put")])
def test_json_nested_past_the_parsers_recursion_is_a_400(client, path, method):
    """json.loads raises RecursionError (not a ValueError) on deeply nested arrays: it was a 500."""
    for body in ("[" * 100000 + "]" * 100000, '{"prompt": ' + "[" * 100000 + "]" * 100000 + "}"):
        answer = getattr(client, method)(path, data=body, content_type="application/json")
        assert answer.status_code == 400
        assert answer.get_json() == {"message": "the request body nests too deeply to be read as JSON"}
    ok = client.post("/v1/completions", json={"prompt": "1 2", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200
