"""Errors on the OpenAI routes in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, as
OpenAI's API and vLLM answer them: the server answered ``{"message": ...}``, so OpenAI's client found
no ``type`` or ``param`` in the error. Megatron's ``PUT /api`` keeps ``{"message": ...}``."""

import pytest

from tests.inference_helpers import openai_client as openai_client_of
from tests.inference_helpers import served_gpt

pytest.importorskip("flask")

CHAT = {"messages": [{"role": "user", "content": "1 2"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def served():
    return served_gpt()


@pytest.fixture(scope="module")
def client(served):
    return served[0]


def error(message, kind, param=None, code=400):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@pytest.mark.parametrize("path, body, message, param", [
    ("/v1/completions", {"prompt": "1", "max_tokens": -1}, "max_tokens must be at least 0, got -1", "max_tokens"),
    ("/v1/completions", {"prompt": "1", "logit_bias": {"5": 200}}, "logit_bias[5] must be at most 100.0, got 200",
     "logit_bias[5]"),
    ("/v1/completions", {"prompt": "1", "max_token": 3}, "unknown field 'max_token'; the fields are", "max_token"),
    ("/v1/completions", {"prompt": "1", "suffix": "2"}, "suffix (insertion) is not supported; drop it", "suffix"),
    ("/v1/completions", {"prompt": "1", "top_k": 5, "top_p": 0.5}, "cannot set both top_k and top_p", None),
    ("/v1/chat/completions", dict(CHAT, messages=[3]), "messages[0]", "messages[0]"),
    ("/v1/chat/completions", dict(CHAT, messages="hi"), "'messages' must be a non-empty list", "messages"),
    ("/v1/chat/completions", dict(CHAT, temperature="hot"), "temperature must be a number", "temperature"),
])
def test_a_bad_request_is_openais_400_naming_the_field(client, path, body, message, param):
    answer = client.post(path, json=body)
    assert answer.status_code == 400
    got = answer.get_json()
    assert got["error"]["message"].startswith(message)
    assert got == error(got["error"]["message"], "invalid_request_error", param)


def test_the_other_v1_errors_take_openais_shape(client, served, monkeypatch):
    body = {"prompt": "1 2", "max_tokens": 1}
    answer = client.post("/v1/completions", json=dict(body, model="gpt-4"))
    assert (answer.status_code, answer.get_json()) == (404, error(
        "The model `gpt-4` does not exist; this server serves `megatron_lite` (--model-name)", "not_found_error",
        "model", 404))
    answer = client.post("/v1/complete", json=body)
    assert answer.status_code == 404 and answer.get_json()["error"]["type"] == "not_found_error"
    assert answer.get_json()["error"]["message"].startswith("no route POST /v1/complete; the routes are")
    answer = client.get("/v1/completions")
    assert (answer.status_code, answer.get_json()) == (405, error(
        "/v1/completions does not take GET; it takes POST", "invalid_request_error", code=405))
    big = '{"prompt": "1", "user": "' + "x" * 32 * 2**20 + '"}'
    answer = client.post("/v1/completions", data=big, content_type="application/json")
    assert answer.status_code == 413 and answer.get_json()["error"]["type"] == "invalid_request_error"
    healthy = served[1].forward
    monkeypatch.setattr(served[1], "forward", lambda *a, **k: healthy(*a, **k).fill_(float("nan")))
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 500 and answer.get_json()["error"]["type"] == "server_error"
    assert answer.get_json()["error"]["message"].startswith("NonFiniteLogitsError: the model's logits hold NaN")


def test_megatrons_route_and_the_rest_keep_the_message_shape(client):
    answer = client.put("/api", json={"prompts": ["1"], "tokens_to_generate": -1})
    assert answer.status_code == 400 and set(answer.get_json()) == {"message"}
    assert set(client.get("/nope").get_json()) == {"message"}
    assert set(client.post("/api").get_json()) == {"message"}  # 405


@pytest.fixture
def openai_client(client):
    return openai_client_of(client.application)


def test_openais_client_raises_our_message_and_field(openai_client):
    openai, api = openai_client
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model="megatron_lite", prompt="1", max_tokens=-1)
    assert bad.value.message.endswith("max_tokens must be at least 0, got -1")
    assert "{" not in bad.value.message  # the message, not the body printed
    assert (bad.value.type, bad.value.param) == ("invalid_request_error", "max_tokens")
    with pytest.raises(openai.NotFoundError) as unknown:
        api.chat.completions.create(model="gpt-4", messages=CHAT["messages"])
    assert unknown.value.message.endswith("The model `gpt-4` does not exist; this server serves `megatron_lite` "
                                          "(--model-name)")
    assert unknown.value.param == "model"


def test_openais_client_raises_an_error_sent_mid_stream(openai_client, served, monkeypatch):
    openai, api = openai_client
    healthy = served[1].forward
    monkeypatch.setattr(served[1], "forward", lambda *a, **k: healthy(*a, **k).fill_(float("nan")))
    with pytest.raises(openai.APIError) as failed:
        list(api.completions.create(model="megatron_lite", prompt="1 2", max_tokens=3, stream=True))
    assert failed.value.message.startswith("NonFiniteLogitsError: the model's logits hold NaN")
    assert failed.value.type == "server_error"
