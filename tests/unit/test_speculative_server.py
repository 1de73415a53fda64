"""The text-generation server with ``--num-speculative-tokens`` (a SpeculativeEngine with ``fall_back``,
megatron_lite/inference/speculative.py and batch_runner.py), Flask's test client in-process.

- Greedy answers with speculation equal those without, JSON for JSON (ids and timestamps aside,
  log-probs within 1e-5): /v1/completions and /v1/chat/completions, streamed and not, and PUT /api,
  with requests one at a time and with continuous batching; the drafter is an oracle that is wrong
  every third draft, so rounds keep all, some or none of their drafts, and every one of these
  requests ran with drafts (``served``).
- Several prompts (``PUT /api``) and ``n`` 2 run as one speculative batch.
- A request speculation does not serve (stop strings, a penalty, streamed logprobs) falls back: it gets the answer it gets without the flag (with continuous batching it runs
  in the batch), counted as ``fell_back``.
- Concurrent requests, some speculative and some batched, each get their own answer.
- The tool: the flag's refusals in one line, and the totals line it prints when it stops.
"""

import json
import threading
import time

import pytest
import torch

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.speculative import MTPDrafter, SpeculativeEngine, served_line
from tests.inference_helpers import MAX_LEN, VOCAB, assert_json_close, mtp_model

pytest.importorskip("flask")
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}"
GREEDY = [  # (method, route, body): every one speculation serves
    ("post", "/v1/completions", {"prompt": "5 17 42 8", "max_tokens": 14, "temperature": 0, "logprobs": 2}),
    ("post", "/v1/completions", {"prompt": "3 1 4", "max_tokens": 10, "temperature": 0, "stream": True}),
    ("post", "/v1/completions", {"prompt": "9 2", "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 1}),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "2 7 1 8"}], "max_tokens": 12,
                                      "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "6 6"}], "max_tokens": 9,
                                      "temperature": 0, "stream": True}),
    ("put", "/api", {"prompts": ["4 4 8 15"], "tokens_to_generate": 11, "top_k": 1, "logprobs": True}),
    ("put", "/api", {"prompts": ["4 4 8", "1 2", "9 9 9 9 9 3"], "tokens_to_generate": 6, "top_k": 1, "logprobs": True}),
    ("post", "/v1/completions", {"prompt": "5 17", "max_tokens": 7, "temperature": 0, "n": 2}),
]
FALLBACK = [  # what speculation does not serve: the plain engine runs it
    ("post", "/v1/completions", {"prompt": "5 17 42", "max_tokens": 12, "temperature": 0, "stop": ["7"]}),
    ("post", "/v1/completions", {"prompt": "3 3", "max_tokens": 6, "temperature": 0, "presence_penalty": 0.5}),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "2 7"}], "max_tokens": 6,
                                      "temperature": 0, "stream": True, "logprobs": True}),
]


@pytest.fixture(scope="module")
def model():
    return mtp_model("rope_gqa", 3)


@pytest.fixture
def oracle(model, monkeypatch):
    """Drafts: the main model's greedy token after the context (one uncached forward pass), but a
    wrong one every third time."""
    calls = []

    def pick(self, logits, depth, context):
        with torch.no_grad():
            best = int(model(torch.tensor([context]))[0, -1, :VOCAB].argmax())
        calls.append(depth)
        return (best if len(calls) % 3 else (best + 1) % VOCAB), None

    monkeypatch.setattr(MTPDrafter, "pick", pick)
    return calls


def engine_of(model, speculative: bool):
    kw = dict(vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    if speculative:
        return SpeculativeEngine(model, num_speculative_tokens=3, fall_back=True, **kw)
    return InferenceEngine(model, **kw)


class Served:
    """A test client of the server over ``engine``: one request at a time, or continuous batching
    over 4 rows with the engine's loop in a thread (as BatchRunner.serve runs it)."""

    def __init__(self, engine, batched: bool):
        from megatron_lite.inference.batch_runner import BatchRunner
        from megatron_lite.inference.server import Runner, create_app

        tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
        self.runner = BatchRunner(engine, 4) if batched else Runner(engine)
        self.app = create_app(self.runner, tokenizer, chat_template=TEMPLATE)
        self.halt, self.thread = False, None
        if batched:
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()

    def _loop(self):
        while not self.halt:
            if not self.runner.work():
                time.sleep(0.005)

    def ask(self, method, route, body):
        response = getattr(self.app.test_client(), method)(route, json=body)
        assert response.status_code == 200, response.get_data(as_text=True)
        if response.mimetype == "text/event-stream":
            blocks = response.get_data(as_text=True).split("\n\n")[:-1]
            return [json.loads(b[len("data: "):]) if b != "data: [DONE]" else "[DONE]" for b in blocks]
        return response.get_json()

    def close(self):
        self.halt = True
        if self.thread is not None:
            self.thread.join(timeout=30)


def plain(answer):
    """``answer`` without what differs between two servers' answers to one request (ids, timestamps)."""
    if isinstance(answer, dict):
        return {k: plain(v) for k, v in answer.items() if k not in ("id", "created")}
    if isinstance(answer, list):
        return [plain(v) for v in answer]
    return answer


@pytest.fixture(scope="module")
def wanted(model):
    """Every request's answer without speculation (one at a time)."""
    server = Served(engine_of(model, False), batched=False)
    return [plain(server.ask(*request)) for request in GREEDY + FALLBACK]


@pytest.mark.parametrize("batched", [False, True], ids=["one_at_a_time", "continuous_batching"])
def test_greedy_answers_with_drafts_equal_those_without(model, oracle, wanted, batched):
    engine = engine_of(model, True)
    server = Served(engine, batched)
    try:
        for request, want in zip(GREEDY, wanted):
            assert_json_close(plain(server.ask(*request)), want, f"{request[1]} {request[2]}")
    finally:
        server.close()
    served = engine.served
    assert served["requests"] == len(GREEDY) and served["fell_back"] == 0
    assert 0 < served["accepted"] < served["drafted"] and served["tokens"] > served["verify_steps"], served
    assert oracle and set(oracle) == {1, 2, 3}


@pytest.mark.parametrize("batched", [False, True], ids=["one_at_a_time", "continuous_batching"])
def test_what_speculation_does_not_serve_falls_back_to_the_answer_without_it(model, oracle, wanted, batched):
    engine = engine_of(model, True)
    server = Served(engine, batched)
    try:
        for request, want in zip(FALLBACK, wanted[len(GREEDY):]):
            assert_json_close(plain(server.ask(*request)), want, f"{request[1]} {request[2]}")
    finally:
        server.close()
    assert engine.served["requests"] == 0 and engine.served["fell_back"] == len(FALLBACK) and not oracle
    if batched:  # the batch ran them, not the engine's plain steps
        assert server.runner.batch.next_rid == len(FALLBACK)


def test_concurrent_requests_with_and_without_drafts_each_get_their_answer(model, oracle, wanted):
    engine = engine_of(model, True)
    server = Served(engine, batched=True)
    requests = GREEDY + FALLBACK
    answers = {}

    def client(i):
        answers[i] = plain(server.ask(*requests[i]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        server.close()
    assert sorted(answers) == list(range(len(requests)))
    for i, want in enumerate(wanted):
        assert_json_close(answers[i], want, f"{requests[i][1]} {requests[i][2]}")
    assert engine.served["requests"] == len(GREEDY) and not server.runner.busy


def test_served_line_sums_up_the_speculation():
    served = dict(requests=3, fell_back=2, verify_steps=10, drafted=20, accepted=15, tokens=25)
    assert served_line(served, 2) == ("speculative decoding (2 token(s) per draft): 3 request(s) with drafts, "
                                      "2.50 tokens per verify step, 75% of 20 drafts accepted; 2 without "
                                      "(fields it does not support)")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.inference_helpers import save_model

    root = tmp_path_factory.mktemp("specserve")
    save_model("mla_mtp", str(root / "mla_mtp"))  # one MTP depth
    save_model("rope_gqa", str(root / "plain"))
    return str(root)


@pytest.mark.parametrize("load, flags, words", [
    ("mla_mtp", ["--num-speculative-tokens", "2"], "has 1 multi-token prediction head(s) (--mtp-num-layers 1); pass at most 1"),
    ("plain", ["--num-speculative-tokens", "1"], "no multi-token prediction heads"),
    ("mla_mtp", ["--num-speculative-tokens", "1", "--no-kv-cache"], "leave out --no-kv-cache"),
    ("mla_mtp", ["--num-speculative-tokens", "0"], "must be at least 1"),
])
def test_the_server_tool_refuses_what_cannot_speculate_in_one_line(checkpoints, capsys, load, flags, words):
    from tests.cli_errors import refused_line
    from tests.tools import load_tool

    server = load_tool("run_text_generation_server")
    argv = ["--load", f"{checkpoints}/{load}", "--port", "0", "--inference-max-requests", "1", *flags]

    def call():
        raise SystemExit(server.main(argv))

    refused_line(capsys, call, "--num-speculative-tokens", words)


def test_the_server_tool_speculates_falls_back_and_prints_the_totals_when_it_stops(checkpoints, capsys, monkeypatch):
    """tools/run_text_generation_server.py --num-speculative-tokens 1 (continuous batching, in a thread):
    a one-prompt request runs with drafts, one with a stop string falls back to the batch, and the line printed
    when the server stops counts them."""
    from megatron_lite.inference.server import StopFlag
    from tests.tools import load_tool

    httpx = pytest.importorskip("httpx")
    tool = load_tool("run_text_generation_server")
    made, stops, code = [], [], {}
    real = tool.make_server
    monkeypatch.setattr(tool, "make_server", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])

    class Stop(StopFlag):  # no signal handlers off the main thread
        def __init__(self, signals=False):
            super().__init__(False)
            stops.append(self)

    monkeypatch.setattr(tool, "StopFlag", Stop)
    argv = ["--load", f"{checkpoints}/mla_mtp", "--port", "0", "--num-speculative-tokens", "1"]
    thread = threading.Thread(target=lambda: code.update(rc=tool.main(argv)), daemon=True)
    thread.start()
    for _ in range(600):
        if stops or not thread.is_alive():
            break
        time.sleep(0.05)
    try:
        url = f"http://127.0.0.1:{made[0].server_port}/v1/completions"
        for body in ({"prompt": "5 17 42", "max_tokens": 6, "temperature": 0}, {"prompt": "3 1", "max_tokens": 4, "stop": ["7"]}):
            assert httpx.post(url, json=body, timeout=60).status_code == 200
    finally:
        if stops:
            stops[0].request()
        thread.join(timeout=60)
    assert code == {"rc": 0}
    out = capsys.readouterr().out
    assert "speculative decoding (1 token(s) per draft): 1 request(s) with drafts" in out, out
    assert "; 1 without (fields it does not support)" in out and out.rstrip().endswith("server stopped")


@pytest.mark.parametrize("batched", [False, True], ids=["one_at_a_time", "continuous_batching"])
def test_a_speculative_stream_whose_client_left_stops_at_the_next_verify_step(model, wanted, monkeypatch, batched):
    """The client reads 3 chunks of a 40-token stream, then leaves: the request ends at its next verify
    step (counted, not timed: with the batch's engine thread the drafter waits until the client has
    left), and the next request gets its answer."""
    from megatron_lite.inference.batch_runner import Steps
    from megatron_lite.inference.server import Cancellable

    gate = threading.Event()

    def pick(self, logits, depth, context):
        if batched and depth == 1 and len(context) >= 4 + 6:  # the engine runs ahead of the reader (6 tokens
            assert gate.wait(timeout=60)  # out): hold it until the client left
        return int(logits.argmax()), None

    monkeypatch.setattr(MTPDrafter, "pick", pick)
    for kind in (Steps, Cancellable):
        real = kind.cancel
        monkeypatch.setattr(kind, "cancel", lambda self, real=real: (real(self), gate.set()))
    engine = engine_of(model, True)
    server = Served(engine, batched)
    try:
        body = {"prompt": "5 17 42 8", "max_tokens": 40, "temperature": 0, "stream": True}
        response = server.app.test_client().post("/v1/completions", json=body, buffered=False)
        chunks = iter(response.response)
        read = [next(chunks) for _ in range(3)]
        response.close()  # the client leaves: the server's generator is closed (drain)
        assert gate.is_set() and all(b"data: " in c for c in read)
        assert 3 <= engine.timings["tokens"] + 1 <= 6 + 4, engine.timings  # one verify step after it: not 40 tokens
        assert_json_close(plain(server.ask(*GREEDY[0])), wanted[0], "the next request")
    finally:
        server.close()
    assert engine.served["requests"] == 2 and not (batched and server.runner.busy)


def test_concurrent_speculative_requests_run_as_one_batch_and_a_client_leaving_stops_its_own(model, oracle):
    """Three queued greedy requests of equal parameters run as one speculative batch (a fourth, other
    parameters, after it); each gets plain greedy decoding of its prompt, except the one whose client
    left, which stopped at the first verify step while the others went on."""
    from megatron_lite.inference.batch_runner import BatchRunner
    from megatron_lite.inference.sampling import SamplingParams
    from tests.inference_helpers import prompts

    engine, plain = engine_of(model, True), engine_of(model, False)
    runner, calls = BatchRunner(engine, 4), []
    stream = engine.stream
    engine.stream = lambda p, params, **kw: calls.append(len(p)) or stream(p, params, **kw)
    params = SamplingParams(tokens_to_generate=12, top_k=1, stop_on_eod=False)
    batch = prompts(4, seed=2, lengths=(4, 7, 2, 5))
    tickets = [runner.submit([p], params) for p in batch[:3]]
    tickets.append(runner.submit(batch[3:], SamplingParams(tokens_to_generate=5, top_k=1)))
    tickets[1].cancelled.set()  # what its Steps.cancel does when its streaming client leaves
    while runner.work():
        pass
    results = [t.result() for t in tickets]
    assert calls == [3, 1] and engine.served["requests"] == 4 and not runner.busy
    for i in (0, 2):
        assert results[i][0].tokens == plain.generate([batch[i]], params)[0].tokens
    assert results[3][0].tokens == plain.generate(batch[3:], SamplingParams(tokens_to_generate=5, top_k=1))[0].tokens
    assert len(results[1][0].generated) == 1  # the prefill's token, then no verify step
