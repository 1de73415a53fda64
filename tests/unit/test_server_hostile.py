"""What real clients send that is not a request the fields can judge (Flask's test client, and a
real socket where the connection itself misbehaves): each gets a 400 naming the problem, never a
500 with a traceback nor a server that stops answering."""

import pytest

from megatron_lite.inference.http_errors import error_body
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
        assert answer.get_json() == error_body(path, "the request body nests too deeply to be read as JSON", 400)
    ok = client.post("/v1/completions", json={"prompt": "1 2", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


@pytest.mark.parametrize("batched", [False, True])
def test_a_stalled_client_neither_blocks_others_nor_keeps_the_server_from_stopping(monkeypatch, batched):
    """A client that connects and sends nothing, or sends its headers and part of its body, then
    waits: the one-at-a-time server (one thread) waited on it forever, so no other request was
    answered and SIGTERM never took effect; the batching server's in-flight count kept it from
    stopping. Each connection now times out after CLIENT_TIMEOUT_S without bytes."""
    import json
    import socket
    import threading
    import urllib.request

    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference import server as server_module
    from megatron_lite.inference.batch_runner import BatchRunner
    from megatron_lite.inference.server import Runner, StopFlag, create_app, make_server, serve
    from tests.inference_helpers import VOCAB

    monkeypatch.setattr(server_module, "CLIENT_TIMEOUT_S", 0.5)
    engine = served_gpt()[1]
    runner = BatchRunner(engine, 4) if batched else Runner(engine)
    http = make_server(create_app(runner, build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)), "127.0.0.1", 0,
                       threaded=batched)
    stop = StopFlag()
    thread = threading.Thread(target=serve, args=(http, runner, stop), daemon=True)
    thread.start()
    idle = socket.create_connection(("127.0.0.1", http.server_port))
    partial = socket.create_connection(("127.0.0.1", http.server_port))
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"prompt\"")
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{http.server_port}/v1/completions",
                                         data=json.dumps({"prompt": "1 2", "max_tokens": 2}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
        stop.request()
        thread.join(timeout=10)
        assert not thread.is_alive(), (  # stopped while both stalled clients still hold their sockets
            f"in flight {getattr(http.in_flight, 'count', None)}, busy {getattr(runner, 'busy', None)}")
    finally:
        stop.request()
        idle.close()
        partial.close()


def test_the_model_list_names_the_served_model(client):
    """GET /v1/models (the openai client's ``models.list()``, what many OpenAI-compatible tools call
    first to find the model's name) was a 404; it lists the one model, as vLLM does."""
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.server import Runner, create_app
    from tests.inference_helpers import MAX_LEN, VOCAB

    answer = client.get("/v1/models")
    assert answer.status_code == 200
    body = answer.get_json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["megatron_lite"]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == MAX_LEN
    named = create_app(Runner(served_gpt()[1]), build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1),
                       model_name="tiny").test_client()
    assert named.get("/v1/models").get_json()["data"][0]["id"] == "tiny"
    assert named.post("/v1/completions", json={"prompt": "1", "max_tokens": 1}).get_json()["model"] == "tiny"


ROUTES = ("PUT /api, GET /health, POST /v1/chat/completions, POST /v1/completions, GET /v1/models")


@pytest.mark.parametrize("method, path", [("post", "/v1/complete"), ("get", "/"), ("post", "/v1/engines/x/completions")])
def test_an_unknown_route_is_a_json_404_naming_the_routes(client, method, path):
    """Flask answered an unknown route with its HTML page, which OpenAI-compatible clients cannot read."""
    answer = getattr(client, method)(path, json={"prompt": "1"})
    assert answer.status_code == 404 and answer.is_json
    assert answer.get_json() == error_body(path, f"no route {method.upper()} {path}; the routes are {ROUTES}", 404)


@pytest.mark.parametrize("method, path, takes", [("get", "/v1/completions", "POST"), ("post", "/api", "PUT"),
                                                 ("delete", "/v1/models", "GET")])
def test_a_wrong_method_is_a_json_405_naming_the_methods(client, method, path, takes):
    answer = getattr(client, method)(path)
    assert answer.status_code == 405 and answer.is_json
    assert answer.get_json() == error_body(path, f"{path} does not take {method.upper()}; it takes {takes}", 405)
    assert takes in answer.headers["Allow"]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "1 2", "max_tokens": 1}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}],
                                                                  "max_tokens": 1})])
def test_a_model_other_than_the_served_one_is_a_404_naming_it(client, path, body):
    """A request naming another model was served by this one; vLLM answers 404, and so do we. A
    request without a model (absent, null, "") or naming the served one is answered."""
    answer = client.post(path, json=dict(body, model="gpt-4"))
    assert answer.status_code == 404
    assert answer.get_json() == error_body(path, "The model `gpt-4` does not exist; "
                                                 "this server serves `megatron_lite` (--model-name)", 404, "model")
    for model in ({}, {"model": None}, {"model": ""}, {"model": "megatron_lite"}):
        assert client.post(path, json=dict(body, **model)).status_code == 200, model
    assert client.post(path, json=dict(body, model=3)).status_code == 400  # not a string: a bad request


def test_a_body_over_the_limit_is_a_json_413_naming_it(client):
    """No bound on the body: a client could make the server read any amount into memory. Bodies
    over MAX_BODY_BYTES (32 MiB) get 413 naming the limit; one just under it is read."""
    limit = 32 * 2**20  # server.MAX_BODY_BYTES, as docs/inference.md gives it
    big = '{"prompt": "1", "max_tokens": 1, "user": "' + "x" * limit + '"}'
    for path, method in (("/v1/completions", "post"), ("/api", "put")):
        answer = getattr(client, method)(path, data=big, content_type="application/json")
        assert answer.status_code == 413
        assert answer.get_json() == error_body(path, f"the request body ({len(big)} bytes) is larger than the "
                                                     f"server's limit of {limit} bytes (32 MiB); send fewer or "
                                                     "shorter prompts per request", 413)
    under = '{"prompt": "1", "max_tokens": 1, "user": "' + "x" * (limit - 100) + '"}'
    assert client.post("/v1/completions", data=under, content_type="application/json").status_code == 200


def test_a_response_whose_close_raises_is_still_counted_out():
    """The batching server does not stop while InFlight counts a request. werkzeug's ClosingIterator
    skipped the count's callback when the app's own close raised first (a teardown failing on a client's
    timed-out socket), so that request stayed counted and SIGTERM never took effect."""
    from megatron_lite.inference.server import InFlight

    class Failing(list):
        def close(self):
            raise TimeoutError("timed out")

    counted = InFlight(lambda environ, start_response: Failing([b"x"]))
    answer = counted({}, None)
    assert counted.count == 1 and list(answer) == [b"x"]
    with pytest.raises(TimeoutError):
        answer.close()
    assert counted.count == 0
