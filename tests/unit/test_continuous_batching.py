"""Continuous batching (megatron_lite/inference/scheduler.py, paged_cache.py) in one process.

The key property: a request's output is the same whether it runs alone (the static engine's
``generate`` over its prompts) or in a batch that others join and leave mid-way: identical tokens
(greedy, and seeded samples: each request has its own generator), log-probs within 1e-5 (fp32;
only the order of the sums inside attention changes), the same finish reasons; for GPT (learned
positions) and DeepSeek's MLA (compressed latent cache, RoPE per row). Also: the cache's row
bookkeeping (blocks taken as rows grow, given back, block 0 read for keys a row does not own), a short request sent after a long one ends first (counted in steps), and a request
whose logits turn NaN fails alone.
"""

import pytest
import torch

from megatron_lite.inference.paged_cache import PagedCache
from megatron_lite.inference.sampling import NonFiniteLogitsError, SamplingParams
from megatron_lite.inference.scheduler import Scheduler
from tests.batching_helpers import assert_same, batching_requests, run, saved_engines
from tests.inference_helpers import MAX_LEN, VOCAB, prompts


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return saved_engines(str(tmp_path_factory.mktemp("contbatch")), ("gpt", "mla_mtp"))


def test_cache_rows_take_blocks_as_they_grow_and_give_them_back():
    cache = PagedCache(4, 10, block_size=2, num_blocks=6)
    assert cache.allocate(2, 5) == [0, 1] and cache.available == 0  # 2 rows x 3 blocks promised
    assert not cache.fits(1, 1) and cache.fits(0, 1)
    with pytest.raises(ValueError, match="has 0 blocks free of 6; asked for 1"):
        cache.allocate(1, 1)
    positions, mask = cache.begin([0, 1], 3, "cpu")  # a prefill of 3 tokens in rows 0 and 1
    k = torch.arange(2 * 3, dtype=torch.float).view(3, 2, 1)  # [s, b, 1]: token t of batch row i = 2t + i
    (keys,) = cache.append(1, k)
    cache.advance()
    assert cache.lengths == [3, 3, 0, 0] and keys[:, :, 0].tolist() == k[:, :, 0].tolist()
    assert cache.tables[:2] == [[1, 2], [3, 4]] and cache.free_blocks == [5, 6]  # 2 blocks each, lazily
    cache.release([0])  # its blocks and its third, promised block go back
    assert cache.free_blocks == [5, 6, 1, 2] and cache.available == 3
    assert cache.allocate(1, 3) == [0]
    positions, mask = cache.begin([0], 2, "cpu")  # the new occupant reuses a freed block
    cache.append(1, torch.full((2, 1, 1), 7.0))
    cache.advance()
    assert cache.tables[0] == [5] and cache.free_blocks == [6, 1, 2]
    cache.memory[1][0][6 * 2:7 * 2] = float("nan")  # stale NaN in the free block row 0 takes next
    positions, mask = cache.begin([1, 0], 1, "cpu")  # rows at lengths 3 and 2 decode together
    assert positions.tolist() == [[3], [2]] and cache.tables[:2] == [[5, 6], [3, 4]]
    assert mask.shape == (2, 1, 1, 4) and mask[:, 0, 0].tolist() == [[False] * 4, [False, False, False, True]]
    (keys,) = cache.append(1, torch.tensor([[[-1.0], [-2.0]]]))
    cache.advance()
    assert keys[:, 0, 0].tolist() == [1.0, 3.0, 5.0, -1.0]
    assert keys[:, 1, 0].tolist() == [7.0, 7.0, -2.0, 0.0]  # its stale slot past its length: read from block 0
    with pytest.raises(ValueError, match="row 0 of the key/value cache holds 2 blocks of 2 tokens; asked for positions 3..4"):
        cache.begin([0], 2, "cpu")  # beyond what it was promised
    with pytest.raises(ValueError, match="row 3 of the key/value cache is not in use"):
        cache.release([3])
    cache.release([1, 0])
    assert sorted(cache.free_blocks) == list(range(1, 7)) and cache.free == [0, 1, 2, 3] and cache.available == 6
    assert PagedCache(3, 10, block_size=4).num_blocks == 3 * 3  # default: every row can reach the full context


@pytest.mark.parametrize("variant", ["gpt", "mla_mtp"])
def test_a_request_batched_with_others_joining_and_leaving_equals_it_alone(engines, variant):
    engine = engines[variant]
    requests = batching_requests()
    alone = [engine.generate(p, params) for p, params in requests]
    stop = alone[0][0].generated[5]  # the greedy request also ends at a stop token, mid-way
    requests[0] = (requests[0][0], SamplingParams(tokens_to_generate=24, top_k=1, top_n_logprobs=2,
                                                  stop_token_ids=(stop,)))
    alone[0] = engine.generate(*requests[0])
    assert alone[0][0].finish_reason == "stop"
    for max_rows, joins in ((6, [0, 2, 5, 5]), (3, [0, 0, 1, 3])):  # with 3 rows requests wait for free ones
        results, _, events = run(Scheduler(engine, max_rows), requests, joins)
        for i in range(len(requests)):
            assert_same(alone[i], results[i])
    streamed = [e.step for e in events if e.rid == 3]  # each step's log-probs, joined, start with the result's
    joined = [sum((s.log_probs[row] for s in streamed), []) for row in range(2)]
    assert [j[:len(r.log_probs)] for j, r in zip(joined, results[3])] == [r.log_probs for r in results[3]]
    assert [[t for s in streamed if (t := s[row]) is not None] for row in range(2)] == [r.generated for r in results[3]]


def test_a_short_request_sent_after_a_long_one_finishes_first(engines):
    engine = engines["gpt"]
    long = ([prompts(1)[0]], SamplingParams(tokens_to_generate=40, top_k=1, stop_on_eod=False))
    short = ([prompts(2)[1]], SamplingParams(tokens_to_generate=3, top_k=1, stop_on_eod=False))
    scheduler = Scheduler(engine, 2)
    results, ended, _ = run(scheduler, [long, short], [0, 4])
    assert ended == {1: 4 + 2, 0: 39}  # short: its prefill step and two more; long: 40 steps from step 0
    assert scheduler.steps == 40 and len(results[1][0].generated) == 3
    assert scheduler.cache.free == [0, 1] and scheduler.cache.lengths == [0, 0]


def test_a_request_whose_logits_turn_nan_fails_alone(engines, monkeypatch):
    engine = engines["gpt"]
    healthy = engine.forward
    poison = 97  # a prompt holding this token gets NaN logits

    def forward(tokens, *args, **kw):
        logits = healthy(tokens, *args, **kw)
        if kw:  # the batch's forward passes: poison the rows that read the marked prompt
            bad = (tokens == poison).any(dim=1) if tokens.shape[1] > 1 else torch.zeros(len(tokens), dtype=torch.bool)
            logits[bad] = float("nan")
        return logits

    monkeypatch.setattr(engine, "forward", forward)
    good = ([prompts(1)[0]], SamplingParams(tokens_to_generate=6, top_k=1))
    bad = ([[3, poison, 5]], SamplingParams(tokens_to_generate=6, top_k=1))
    scheduler = Scheduler(engine, 4)
    scheduler.add(*good)
    events = scheduler.run_step()
    scheduler.add(*bad)
    while scheduler.busy:
        events += scheduler.run_step()
    errors = [e for e in events if e.error is not None]
    assert [(e.rid, type(e.error)) for e in errors] == [(1, NonFiniteLogitsError)]
    monkeypatch.setattr(engine, "forward", healthy)
    assert [e.results for e in events if e.rid == 0 and e.results][0][0].tokens == engine.generate(*good)[0].tokens
    assert scheduler.cache.free == [0, 1, 2, 3]


@pytest.mark.parametrize("where", ["sample", "admission", "take"])
def test_one_request_failing_inside_a_batched_step_fails_alone(engines, monkeypatch, where):
    """A request whose own sampling, admission or bookkeeping raises (here: any request seeded 13)
    ends with that error alone; the requests stepped beside it keep their tokens and log-probs."""
    from megatron_lite.inference import scheduler as sched

    engine = engines["gpt"]
    marked = lambda r: r.params.random_seed == 13  # noqa: E731
    target = {"sample": "sample", "take": "take", "admission": "__init__"}[where]
    healthy = getattr(sched.BatchRequest, target)

    def broken(self, *args):
        if marked(self if where != "admission" else args[1]):
            raise RuntimeError("logits processor failed")
        return healthy(self, *args)

    requests = batching_requests()
    bad = ([prompts(1, seed=9)[0]], SamplingParams(tokens_to_generate=6, top_k=3, random_seed=13))
    alone = [engine.generate(p, params) for p, params in requests]
    monkeypatch.setattr(sched.BatchRequest, target, broken)
    scheduler = Scheduler(engine, 8, block_size=4, max_batched_tokens=8)
    for request in requests[:2]:
        scheduler.add(*request)
    events = scheduler.run_step() + scheduler.run_step()
    assert scheduler.add(*bad) == 2
    for request in requests[2:]:
        scheduler.add(*request)
    while scheduler.busy:
        events += scheduler.run_step()
    errors = [(e.rid, str(e.error)) for e in events if e.error is not None]
    assert errors == [(2, "logits processor failed")]
    results = {e.rid - (e.rid > 2): e.results for e in events if e.results is not None}
    for i in range(len(requests)):
        assert_same(alone[i], results[i])
    assert scheduler.cache.free == list(range(8)) and scheduler.cache.available == scheduler.cache.num_blocks


@pytest.mark.parametrize("params, n, message", [
    (SamplingParams(beam_width=2), 1, "one-at-a-time engine"),
    (SamplingParams(tokens_to_generate=0), 1, "one-at-a-time engine"),
    (SamplingParams(), 3, "more sequences than --inference-max-requests 2"),
    (SamplingParams(top_k=2, top_p=0.5), 1, "cannot set both top_k and top_p"),
    (SamplingParams(tokens_to_generate=MAX_LEN), 1, "more than the model's"),
])
def test_what_the_batch_does_not_run_is_refused_before_it_joins(engines, params, n, message):
    scheduler = Scheduler(engines["gpt"], 2)
    with pytest.raises(ValueError, match=message):
        scheduler.add([[1, 2]] * n, params)
    assert not scheduler.busy


def test_the_server_batches_unless_told_one_at_a_time(engines, tmp_path, capsys):
    from megatron_lite.inference.batch_runner import BatchRunner, make_runner
    from megatron_lite.inference.server import Runner
    from tests.tools import load_tool

    engine = engines["gpt"]
    assert type(make_runner(engine, 8)) is BatchRunner and make_runner(engine, 8).batch.cache.max_rows == 8
    assert type(make_runner(engine, 1)) is Runner
    engine.use_cache = False  # --no-kv-cache: one request at a time
    try:
        assert type(make_runner(engine, 8)) is Runner
    finally:
        engine.use_cache = True
    tool = load_tool("run_text_generation_server")
    assert tool.parse_args(["--load", "x"]).inference_max_requests == 8  # Megatron-LM's default
    assert tool.main(["--load", str(tmp_path), "--inference-max-requests", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: --inference-max-requests 0 must be at least 1 (1: one request at a time)"]


def test_a_port_the_server_cannot_listen_on_is_one_line_exit_2(capsys):
    """--port 70000 served on port 4464 (the number wrapped round 65536); a port in use printed
    werkzeug's two lines and exited 1. Both are now one line, exit code 2."""
    import socket

    pytest.importorskip("flask")
    from megatron_lite.inference.server import make_server
    from tests.tools import load_tool

    with pytest.raises(SystemExit) as exit_:
        load_tool("run_text_generation_server").parse_args(["--load", "x", "--port", "70000"])
    assert exit_.value.code == 2
    assert "--port 70000 must be in [0, 65535]" in capsys.readouterr().err
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"^--host 127.0.0.1 --port {port}: Address already in use; pick another"):
            make_server(lambda environ, start_response: [], "127.0.0.1", port)
    finally:
        taken.close()
    assert capsys.readouterr().err == ""


def test_a_stream_whose_client_left_leaves_the_batch_at_the_next_step(engines):
    import threading
    import time

    from megatron_lite.inference.api_stream import drain
    from megatron_lite.inference.batch_runner import BatchRunner

    engine = engines["gpt"]
    runner = BatchRunner(engine, 2)  # its engine loop is run here, step by step (runner.work)
    steps = runner.stream([prompts(1)[0]], SamplingParams(tokens_to_generate=60, top_k=1, stop_on_eod=False))
    for _ in range(2):  # the client reads two steps, then leaves
        runner.work()
        next(steps)
    leaving = threading.Thread(target=drain, args=(steps,), daemon=True)  # the server, when the client is gone
    leaving.start()
    for _ in range(5000):  # until drain has cancelled it
        if runner.cancelled or not leaving.is_alive():
            break
        time.sleep(0.002)
    runner.work()  # the next step: the request leaves the batch, its rows are free
    leaving.join(timeout=20)
    assert not leaving.is_alive() and runner.batch.steps == 2
    assert not runner.busy and runner.batch.cache.free == [0, 1] and runner.batch.cache.lengths == [0, 0]
    short = ([prompts(2)[1]], SamplingParams(tokens_to_generate=4, top_k=1))
    finished = runner.stream(*short)
    while runner.work():
        pass
    assert [t for (t,) in finished] == engine.generate(*short)[0].generated  # the server serves on
    drain(finished)  # a stream read to its end: nothing to cancel, nothing blocks
    assert not runner.cancelled


@pytest.mark.parametrize("where", ["forward", "admission"])
def test_a_failed_step_or_admission_is_answered_and_the_next_requests_run(engines, monkeypatch, where):
    from megatron_lite.inference import scheduler
    from megatron_lite.inference.batch_runner import BatchRunner

    engine = engines["gpt"]
    runner = BatchRunner(engine, 4)
    request = ([prompts(1)[0]], SamplingParams(tokens_to_generate=5, top_k=1))
    decoding = runner.submit(*request)
    runner.work()  # its prefill: it is in the batch
    joining = runner.submit(*request)  # admitted by the step that fails
    healthy = engine.forward

    def broken(*args, **kw):
        raise RuntimeError("CUDA out of memory")

    admit = scheduler.BatchRequest
    monkeypatch.setattr(*((engine, "forward") if where == "forward" else (scheduler, "BatchRequest")), broken)
    assert runner.work()
    monkeypatch.setattr(engine, "forward", healthy)
    monkeypatch.setattr(scheduler, "BatchRequest", admit)
    failed = (decoding, joining) if where == "forward" else (joining,)  # a failed admission fails alone
    for ticket in failed:
        assert list(ticket.items.queue)[-1][0] == "error"  # answered: its handler does not wait forever
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            ticket.result()
    while runner.work():
        pass
    if where == "admission":
        assert decoding.result()[0].tokens == engine.generate(*request)[0].tokens
    assert not runner.busy and runner.batch.cache.free == [0, 1, 2, 3] and not runner.tickets
    after = runner.submit(*request)
    while runner.work():
        pass
    assert after.result()[0].tokens == engine.generate(*request)[0].tokens


def _engine_loop(runner):
    """The server's engine thread, for Flask's test client: run the batch until ``runner.halt`` is set."""
    import threading
    import time

    runner.halt = False

    def loop():
        while not runner.halt:
            if not runner.work():
                time.sleep(0.005)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_megatron_put_api_joins_the_batch_and_answers_as_the_one_at_a_time_server(engines):
    """PUT /api runs in the continuous batch and answers the same JSON; its ``random_seed`` leaves
    the server's generator where the one-at-a-time server's reseeded one ends, so an unseeded
    request after it draws what it draws there."""
    pytest.importorskip("flask")
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.batch_runner import BatchRunner
    from megatron_lite.inference.server import Runner, create_app

    engine = engines["gpt"]
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    seeded = {"prompts": ["5 17 42", "3 1"], "tokens_to_generate": 6, "temperature": 1.5, "random_seed": 7}
    unseeded = {"prompts": ["9 9 2"], "tokens_to_generate": 6, "temperature": 1.5}
    answers = {}
    for name, runner in (("one", Runner(engine)), ("batched", BatchRunner(engine, 4))):
        client = create_app(runner, tokenizer).test_client()
        thread = _engine_loop(runner) if name == "batched" else None
        try:
            answers[name] = [client.put("/api", json=body).get_json() for body in (seeded, unseeded)]
        finally:
            runner.halt = True
        if thread is not None:
            thread.join(timeout=20)
    assert answers["batched"] == answers["one"]
    assert runner.batch.next_rid == 2 and runner.batch.steps >= 6  # both ran in the batch


def test_a_stream_cancelled_while_queued_is_dropped_not_admitted(engines):
    """A streaming client that leaves before its request joined: the request is dropped from the
    queue (it never runs), even when rows are free for it at the next step."""
    from megatron_lite.inference.batch_runner import BatchRunner

    runner = BatchRunner(engines["gpt"], 2)
    steps = runner.stream([prompts(1)[0]], SamplingParams(tokens_to_generate=40, top_k=1, stop_on_eod=False))
    steps.cancel()  # the client left while the request waited for the next step
    runner.work()
    assert runner.batch.steps == 0 and not runner.busy and not runner.tickets
    assert runner.batch.cache.free == [0, 1]
    with pytest.raises(StopIteration):
        next(steps)  # its handler is answered at once


def test_a_seed_too_large_for_a_generator_is_a_400_and_the_batch_serves_on(engines):
    """torch.Generator takes seeds below 2^64: a larger one is refused when the request arrives
    (HTTP 400 naming the field), not when it joins the batch, where it failed every request in it."""
    pytest.importorskip("flask")
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.batch_runner import BatchRunner
    from megatron_lite.inference.server import create_app

    engine = engines["gpt"]
    runner = BatchRunner(engine, 4)
    request = ([prompts(1)[0]], SamplingParams(tokens_to_generate=5, top_k=1))
    decoding = runner.submit(*request)
    runner.work()  # in the batch
    with pytest.raises(ValueError, match=r"random_seed must be an integer in \[0, 2\^64\)"):
        runner.submit([[1, 2]], SamplingParams(tokens_to_generate=5, random_seed=2**64))
    while runner.work():
        pass
    assert decoding.result()[0].tokens == engine.generate(*request)[0].tokens
    client = create_app(runner, build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)).test_client()
    for method, path, body, field in (("post", "/v1/completions", {"prompt": "1 2", "seed": 2**64}, "seed"),
                                      ("put", "/api", {"prompts": ["1 2"], "random_seed": 2**64}, "random_seed")):
        answer = getattr(client, method)(path, json=body)
        got = answer.get_json()
        assert answer.status_code == 400 and (got["error"] if path.startswith("/v1/") else got)["message"].startswith(field)
    assert not runner.busy


def test_megatron_put_api_reuses_cached_prompt_blocks_unless_it_asks_for_logprobs(engines):
    """Without ``logprobs`` the answer shows no prompt log-probs, so a repeated prompt starts after
    its cached blocks (prefix caching); with ``logprobs`` every prompt log-prob is computed."""
    pytest.importorskip("flask")
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.batch_runner import BatchRunner
    from megatron_lite.inference.server import Runner, create_app
    from tests.inference_helpers import assert_json_close

    engine = engines["gpt"]
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    body = {"prompts": ["5 17 42 8 3 1 4 1 5 9"], "tokens_to_generate": 3, "top_k": 1}
    want = [create_app(Runner(engine), tokenizer).test_client().put("/api", json=b).get_json()
            for b in (body, {**body, "logprobs": True})]
    runner = BatchRunner(engine, 4, block_size=4, prefix_caching=True)
    client, thread = create_app(runner, tokenizer).test_client(), _engine_loop(runner)
    try:
        assert [client.put("/api", json=body).get_json() for _ in range(2)] == [want[0]] * 2
        reused = runner.batch.cache.reused_tokens
        assert_json_close(client.put("/api", json={**body, "logprobs": True}).get_json(), want[1])
    finally:
        runner.halt = True
    thread.join(timeout=20)
    assert reused == 8 and runner.batch.cache.reused_tokens == reused  # two blocks once; none with logprobs
