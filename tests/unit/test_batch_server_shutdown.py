"""SIGTERM with continuous batching (megatron_lite/inference/batch_runner.py BatchRunner.serve): the
server stops accepting requests and finishes those it holds, including one whose handler thread
was still reading it (not yet handed to the engine) when the stop came: it is answered, and the
loop ends only after that answer is written."""

import threading

import pytest

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.batch_runner import BatchRunner
from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.sampling import SamplingParams
from megatron_lite.inference.server import StopFlag, create_app, make_server, serve
from tests.inference_helpers import MAX_LEN, VOCAB, build_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("flask")


def test_a_request_being_read_when_the_stop_comes_is_still_answered():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    engine = InferenceEngine(build_model("gpt"), vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod)
    runner = BatchRunner(engine, 4)
    reading, release = threading.Event(), threading.Event()
    tokenize = tokenizer.tokenize

    def slow_tokenize(text):  # the handler thread is reading the request when the stop comes
        reading.set()
        release.wait(30)
        return tokenize(text)

    tokenizer.tokenize = slow_tokenize
    http = make_server(create_app(runner, tokenizer), "127.0.0.1", 0, threaded=True)
    stop = StopFlag()
    engine_loop = threading.Thread(target=serve, args=(http, runner, stop), daemon=True)
    engine_loop.start()
    answer = {}
    client = threading.Thread(target=lambda: answer.update(r=httpx.post(
        f"http://127.0.0.1:{http.server_port}/v1/completions",
        json={"prompt": "5 17 42", "max_tokens": 6, "temperature": 0}, timeout=20)), daemon=True)
    client.start()
    assert reading.wait(30)
    stop.request()  # SIGTERM
    engine_loop.join(timeout=2)  # the loop keeps running for the request it holds
    assert engine_loop.is_alive()
    release.set()
    client.join(timeout=30)
    engine_loop.join(timeout=30)
    assert not engine_loop.is_alive()
    assert answer["r"].status_code == 200
    want = engine.generate([[5, 17, 42]], SamplingParams(tokens_to_generate=6, top_k=1))[0].generated
    assert [int(t) for t in answer["r"].json()["choices"][0]["text"].split()] == want
    assert http.in_flight.count == 0
