"""Continuous batching end to end.

TP2 on two ranks (tests/e2e/contbatch_ranks.py on tests/harness.py's pool: the server's runner without HTTP, rank 1 following
rank 0's broadcast admissions; a paged cache of blocks of 4 tokens, too few for every request at once,
and chunked prefill at 6 tokens per step): requests joining, waiting for blocks and leaving mid-way give,
for GPT and MLA, the tokens the one-process engine gives each request alone (greedy and seeded),
log-probs within 1e-5.
In one process over HTTP: concurrent requests (completions and chat, streamed and not, and Megatron's
PUT /api: several prompts, seeded samples, top-p decay, stop token, add_BOS, log-probs) decode together
and each answer is the one-at-a-time server's (beam search, Megatron's and the OpenAI routes', runs
alone between the steps); a bad PUT /api among them gets its 400 alone.
"""

import json
import threading

import pytest
import torch

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.batch_runner import BatchRunner
from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.loading import load_model, load_tokenizer
from megatron_lite.inference.server import Runner, StopFlag, create_app, make_server, serve
from tests.batching_helpers import (
    CHAT_CACHED,
    PREFIX_CACHED,
    PREFIX_REUSED,
    STOPPING,
    batching_requests,
    chat_turn,
    prefix_requests,
)
from tests.e2e import contbatch_ranks
from tests.harness import run_ranks
from tests.inference_helpers import MAX_LEN, VOCAB, assert_close, assert_json_close, save_model


def engine_for(root):
    model, saved = load_model(root)
    return InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1,
                           tokenizer=build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1))  # STOPPING's stop strings


REQUESTS_RUN = batching_requests() + [STOPPING] + prefix_requests()  # contbatch_ranks.py's, in order


def assert_each_alone(engine, answers, what=""):
    """Each answer of contbatch_ranks.py is the request's alone (a prompt prefix that came from the
    prefix cache holds NaN log-probs: not computed); the last is the chat turn after the first
    prefix request, which reused its answer's blocks too."""
    requests = REQUESTS_RUN + [chat_turn(answers[5][0]["tokens"])]
    assert len(answers) == len(requests)
    for (prompts, params), got, cached in zip(requests, answers, [0] * 5 + PREFIX_CACHED + [CHAT_CACHED]):
        alone = engine.generate(prompts, params)
        assert [g["tokens"] for g in got] == [a.tokens for a in alone], what
        assert [g["finish_reason"] for g in got] == [a.finish_reason for a in alone]
        for g, a in zip(got, alone):
            assert torch.tensor(g["log_probs"][:cached]).isnan().all()
            assert_close(torch.tensor(g["log_probs"][cached:]), torch.tensor(a.log_probs[cached:]), what=what)


def test_tp2_batch_with_requests_joining_and_leaving_equals_each_alone(tmp_path):
    roots = [str(tmp_path / v) for v in ("gpt", "mla_mtp")]
    for variant, root in zip(("gpt", "mla_mtp"), roots):
        save_model(variant, root)
    answers = run_ranks(2, contbatch_ranks.batched_answers, roots, 2, 1)[0]
    for root in roots:
        assert len(answers[root]) == len(REQUESTS_RUN) + 2 and answers[root].pop() == PREFIX_REUSED + CHAT_CACHED
        assert_each_alone(engine_for(root), answers[root], root)
        stopping = [g["finish_reason"] for g in answers[root][4]], len(answers[root][4][0]["tokens"])
        assert stopping == (["stop", "length"], 4 + 3 if "gpt" in root else 4 + 4)  # ended at its stop string


def test_pp2_one_request_failing_in_a_step_fails_alone(tmp_path):
    """PP2: the sampling rank (rank 1) raises for one request inside a batched step; rank 0 answers it
    with that message, the other requests keep the tokens they get alone, every block comes back."""
    root = str(tmp_path / "gpt")
    save_model("gpt", root)
    answers = run_ranks(2, contbatch_ranks.batched_answers, [root], 1, 2, True)[0][root]
    assert answers.pop() == PREFIX_REUSED + CHAT_CACHED and len(answers) == len(REQUESTS_RUN) + 2
    assert answers.pop(-2) == {"error": "RuntimeError: logits processor failed"}
    assert_each_alone(engine_for(root), answers)


httpx = pytest.importorskip("httpx")
pytest.importorskip("flask")


def _serve(root, runner_of, threaded):
    model, saved = load_model(root)
    tokenizer = load_tokenizer(saved)
    engine = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod)
    runner = runner_of(engine)
    http = make_server(create_app(runner, tokenizer, chat_template="{{ messages[0]['content'] }}"), "127.0.0.1", 0,
                       threaded=threaded)
    stop = StopFlag()
    thread = threading.Thread(target=serve, args=(http, runner, stop), daemon=True)
    thread.start()
    return f"http://127.0.0.1:{http.server_port}", runner, stop, thread


REQUESTS = [
    ("POST", "/v1/completions", {"prompt": "5 17 42 8", "max_tokens": 30, "temperature": 0, "logprobs": 2}),
    ("POST", "/v1/completions", {"prompt": ["3 1 4", "1 5 9 2 6"], "max_tokens": 5, "n": 2, "seed": 4,
                                 "temperature": 1.2, "frequency_penalty": 0.5}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "1 2 3"}], "max_tokens": 7, "seed": 1,
                                      "logprobs": True}),
    ("POST", "/v1/completions", {"prompt": "9 9 9", "max_tokens": 12, "temperature": 0, "stream": True}),
    ("POST", "/v1/completions", {"prompt": "4 4", "max_tokens": 9, "top_p": 0.8, "seed": 2, "stream": True,
                                 "logprobs": 1, "echo": True}),
    ("PUT", "/api", {"prompts": ["1 2 3"], "tokens_to_generate": 4, "top_k": 1, "logprobs": True}),
    ("PUT", "/api", {"prompts": ["6 1", "2 8 3 3 5 1 7"], "tokens_to_generate": 6, "top_p": 0.9, "top_p_decay": 0.8,
                     "top_p_bound": 0.5, "temperature": 1.3, "random_seed": 5, "logprobs": True}),
    ("PUT", "/api", {"prompts": ["", "4 5 6"], "add_BOS": True, "tokens_to_generate": 8, "top_k": 3, "random_seed": 9,
                     "stop_token": 50, "stop_on_double_eol": True, "prevent_newline_after_colon": True}),
    ("PUT", "/api", {"prompts": ["1 " * MAX_LEN], "tokens_to_generate": 2}),  # too long: 400, alone
    ("PUT", "/api", {"prompts": ["7 8"], "tokens_to_generate": 3, "beam_width": 2}),
    ("POST", "/v1/completions", {"prompt": ["7 8", "2 3 4"], "max_tokens": 3, "use_beam_search": True, "n": 2,
                                 "best_of": 3, "logprobs": 1}),
]


def _answer(url, method, path, body):
    r = httpx.request(method, url + path, json=body, timeout=120)
    if r.status_code == 400:
        return r.json()
    assert r.status_code == 200, r.text
    if body.get("stream"):
        chunks = [json.loads(b[len("data: "):]) for b in r.text.split("\n\n") if b.startswith("data: {")]
        return {"text": "".join(c["choices"][0]["text"] for c in chunks),
                "logprobs": sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks
                                 if c["choices"][0]["logprobs"]), [])}
    answer = r.json()
    answer.pop("id", None), answer.pop("created", None)
    return answer


def test_concurrent_requests_decode_together_and_answer_as_one_at_a_time(tmp_path):
    root = str(tmp_path / "gpt")
    save_model("gpt", root)
    one = _serve(root, Runner, threaded=False)
    batched = _serve(root, lambda engine: BatchRunner(engine, 16), threaded=True)
    try:
        want = [_answer(one[0], *r) for r in REQUESTS]
        assert "more than the model's" in want[8]["message"]  # the bad one
        runner, covered = batched[1], 8  # the first eight run in the batch (13 sequences)
        admissions, seen = runner.batch.admissions, []

        def all_at_once():  # hold the batch until the five are queued: they must then decode together
            with_pending = len(runner.batch.pending)
            return admissions() if with_pending >= covered or seen else []

        runner.batch.admissions = all_at_once
        step = runner.batch.step
        runner.batch.step = lambda admitted, leaving=(): (seen.append(len(runner.batch.active) + len(admitted))
                                                          or step(admitted, leaving))
        got = [None] * len(REQUESTS)
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _answer(batched[0], *REQUESTS[i])))
                   for i in range(len(REQUESTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert max(seen) == covered  # every OpenAI and Megatron request was in one batch at once
        for i, (g, w) in enumerate(zip(got, want)):
            assert_json_close(g, w, f"request {i}")
        assert runner.batch.cache.free == list(range(16))
    finally:
        for _, _, stop, thread in (one, batched):
            stop.request()
            thread.join(timeout=60)
    assert not batched[3].is_alive()
