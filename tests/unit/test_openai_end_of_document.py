"""The OpenAI routes show no text for the end-of-document token that ends a choice, as OpenAI and
vLLM answer (its text was appended to every answer that ended naturally: GPT-2's
``<|endoftext|>``, a Hugging Face tokenizer's ``</s>`` or ``<|im_end|>``; here NullTokenizer's
"99"); its log-prob is still returned and counted in the usage, streamed or not. ``PUT /api``
keeps Megatron's answer, the token's text included (unchanged here)."""

import json

import pytest

from tests.inference_helpers import served_gpt

pytest.importorskip("flask")
# seeded so that the end-of-document token (99) is the 7th generated token: 58 50 50 50 83 83 99
REQUEST = {"max_tokens": 12, "temperature": 1.0, "seed": 0, "logit_bias": {"99": 3.0}}


@pytest.fixture(scope="module")
def client():
    return served_gpt()[0]


def streamed(client, path, body):
    answer = client.post(path, json={**body, "stream": True})
    chunks = [json.loads(b[len("data: "):]) for b in answer.get_data(as_text=True).split("\n\n")[:-1]
              if b != "data: [DONE]"]
    text = "".join(c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text", "")
                   for c in chunks if c["choices"])
    return text, chunks


def test_completions_end_without_the_end_of_document_text(client):
    body = {"prompt": "5 17 42 8", "logprobs": 1, **REQUEST}
    choice = client.post("/v1/completions", json=body).get_json()
    assert choice["usage"]["completion_tokens"] == 7
    choice = choice["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" 58 50 50 50 83 83", "stop")
    assert choice["logprobs"]["tokens"][-1] == " 99" and len(choice["logprobs"]["token_logprobs"]) == 7
    text, chunks = streamed(client, "/v1/completions", body)
    assert text == choice["text"] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    entries = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert entries == choice["logprobs"]["tokens"]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).get_json()["choices"][0]["text"]
    assert echoed == "5 17 42 8" + choice["text"]
    assert streamed(client, "/v1/completions", {**body, "echo": True})[0] == echoed


def test_chat_ends_without_the_end_of_document_text(client):
    body = {"messages": [{"role": "user", "content": "5 17 42"}], **REQUEST, "seed": 4,  # prompt: 5 17 42 7
            "logit_bias": {"99": 4.0}, "logprobs": True}
    answer = client.post("/v1/chat/completions", json=body).get_json()
    choice = answer["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (" 83 12 50 50 50 33", "stop")
    assert [e["token"] for e in choice["logprobs"]["content"]][-1] == " 99"  # its text after the others
    assert answer["usage"]["completion_tokens"] == 7
    assert streamed(client, "/v1/chat/completions", body)[0] == choice["message"]["content"]
