"""A sequence ends as soon as its text holds one of its OpenAI ``stop`` strings
(megatron_lite/inference/stop_strings.py), in the one-at-a-time engine and in the continuous batch.

The answers are those of the engine without a tokenizer, which decodes on to ``max_tokens`` and
leaves the cut to the answer (what every request got before): the same text, finish_reason, usage
and log-probs, streamed or not, with ``n`` choices of which some stop early and one does not,
``best_of``, ``echo`` and chat; only the decode steps drop (counted), and a request of the batch
frees its rows and blocks as soon as its sequences stop. The check itself ends a sequence exactly at
the token whose text (decoded whole) first completes a stop string, where tokens split UTF-8
characters and stop strings straddle tokens.
"""

import json
import threading
import time

import pytest

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.api_openai import _stop_text
from megatron_lite.inference.batch_runner import BatchRunner
from megatron_lite.inference.engine import Generation, InferenceEngine
from megatron_lite.inference.sampling import SamplingParams
from megatron_lite.inference.server import Runner, create_app
from megatron_lite.inference.stop_strings import StopStrings
from tests.inference_helpers import MAX_LEN, VOCAB, assert_json_close, build_model
from tests.unit.test_openai_stream import STOPS, STREAMED, tokenizers  # noqa: F401 - the fixture

pytest.importorskip("flask")
NULL = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
# Greedy, "5 17 42 8" continues " 98 12 50 50 50 31 ..." and "3 1 4 1 5 9 2 6 5" " 31 31 31 31 31 31 32 66
# 66 66 50 ..."; seeded (0) with n=3 and top_k 4 the choices of "5 17 42 8" are " 10 83 83 ..." (never "50 5"),
# " 50 50 ..." and " 1 50 50 ...".
REQUESTS = [
    ("/v1/completions", {"prompt": ["5 17 42 8", "3 1 4 1 5 9 2 6 5"], "max_tokens": 12, "temperature": 0,
                         "stop": ["2 50", "66 1"], "logprobs": 2}),
    ("/v1/completions", {"prompt": "5 17 42 8", "n": 3, "seed": 0, "top_k": 4, "max_tokens": 10, "stop": "50 5",
                         "logprobs": 1, "echo": True}),
    ("/v1/completions", {"prompt": "5 17 42 8", "best_of": 3, "seed": 0, "top_k": 4, "max_tokens": 10, "stop": "50 5"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "3 1 4 1 5 9 2 6 5"}], "max_tokens": 20,
                              "temperature": 0, "stop": ["31 3"], "logprobs": True, "top_logprobs": 1}),
    ("/v1/completions", {"prompt": "5 17 42 8", "max_tokens": 30, "temperature": 0, "stop": ["12 50"]}),
]


@pytest.fixture(scope="module")
def model():
    return build_model("gpt")


def engine(model, tokenizer):
    return InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=NULL.eod, tokenizer=tokenizer)


def _loop(runner):
    """The batching server's engine thread: run the batch until ``runner.halt``."""
    runner.halt = False

    def loop():
        while not runner.halt:
            if not runner.work():
                time.sleep(0.002)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def answers(runner, count_steps) -> tuple[list, list[int]]:
    """Every request of REQUESTS, non-streamed and streamed (the answers without their id and time),
    and the decode steps each took."""
    client = create_app(runner, NULL, chat_template="{{ messages[0]['content'] }}").test_client()
    thread = _loop(runner) if isinstance(runner, BatchRunner) else None
    out, steps = [], []
    try:
        for path, body in REQUESTS:
            for stream in (False, True) if "best_of" not in body else (False,):
                before = count_steps()
                response = client.post(path, json={**body, "stream": stream} if stream else body)
                text = response.get_data(as_text=True)  # a stream runs while it is read
                assert response.status_code == 200, text
                steps.append(count_steps() - before)
                if stream:
                    chunks = [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: {")]
                    out.append([{k: v for k, v in c.items() if k not in ("id", "created")} for c in chunks])
                else:
                    out.append({k: v for k, v in json.loads(text).items() if k not in ("id", "created")})
    finally:
        runner.halt = True
    if thread is not None:
        thread.join(timeout=30)
    return out, steps


@pytest.mark.parametrize("batched", [False, True], ids=["one_at_a_time", "continuous_batch"])
def test_answers_are_unchanged_and_decode_steps_drop(model, batched):
    def runner_of(tokenizer):
        e = engine(model, tokenizer)
        if batched:
            r = BatchRunner(e, 4)
            return r, lambda: r.batch.steps
        r, steps, stream = Runner(e), [0], e._steps  # count each request's forward steps (streamed or not)

        def counted_stream(*args):
            result = yield from stream(*args)
            steps[0] += e.timings["decode_steps"] + 1
            return result
        e._steps = counted_stream
        return r, lambda: steps[0]

    before, before_steps = answers(*runner_of(None))  # decodes to max_tokens: the answers of before
    after, after_steps = answers(*runner_of(NULL))
    if batched:  # a sequence that stopped left the batch: the others' fp32 sums ran over other rows (~1e-6)
        assert_json_close(after, before)
    else:
        assert after == before
    stopped = [c["finish_reason"] for a in before if isinstance(a, dict) for c in a["choices"]]
    assert stopped.count("stop") >= 6 and "length" in stopped  # the requests hold early and late stops
    # [0]: one prompt never stops (the batch of two runs on); [2], [3]: one choice never stops (n=3);
    # best_of [4]: all three sampled, one never stops; chat [5], [6] and [7], [8] stop early
    assert after_steps[:5] == before_steps[:5]
    assert [a < b for a, b in zip(after_steps[5:], before_steps[5:])] == [True] * 4, (after_steps, before_steps)
    assert after_steps[7] <= 3 < 29 <= before_steps[7]  # "12 50" is complete at the third token of 30


def test_a_request_that_stops_frees_its_rows_and_blocks_while_another_decodes(model):
    """Continuous batch: a long request and one whose stop string appears at its third token; the
    short one ends at that step and gives its row and blocks back (it held them to max_tokens)."""
    long = ([NULL.tokenize("3 1 4 1 5 9 2 6 5")], SamplingParams(tokens_to_generate=40, top_k=1, stop_on_eod=False))
    ended = {}
    for tokenizer in (None, NULL):
        runner = BatchRunner(engine(model, tokenizer), 2, block_size=4)
        short = ([NULL.tokenize("5 17 42 8")], SamplingParams(tokens_to_generate=30, top_k=1, stop_on_eod=False,
                                                             stop_strings=("12 50",)))
        tickets = [runner.submit(*long), runner.submit(*short)]
        while runner.busy:
            runner.work()
            if not tickets[1].items.empty() and list(tickets[1].items.queue)[-1][0] == "done":
                break
        ended[tokenizer is not None] = runner.batch.steps
        cache = runner.batch.cache
        assert len(cache.free) == 1 and sum(cache.reserved) == cache.blocks_for(9 + 40 - 1)  # the long one's only
        result = tickets[1].result()[0]
        assert NULL.detokenize(result.generated).startswith("98 12 50")
        assert result.finish_reason == ("stop" if tokenizer is not None else "length")
        while runner.busy:
            runner.work()
    assert ended == {False: 30, True: 3}


def _first_stop(tokenizer, prompt, generated, stops) -> int | None:
    """The number of generated tokens up to the first whose prefix's whole text holds a stop string."""
    for k in range(1, len(generated) + 1):
        if _stop_text(tokenizer, Generation(prompt + generated[:k], len(prompt), []), stops)[1]:
            return k
    return None


@pytest.mark.parametrize("name", ["gpt2", "sentencepiece", "null"])
@pytest.mark.parametrize("stops", STOPS[1:])
def test_the_check_ends_a_sequence_at_the_token_completing_a_stop_string(tokenizers, name, stops):  # noqa: F811
    """Characters split over tokens, stop strings straddling tokens and starting mid-token: the
    sequence ends exactly where the whole text first holds a stop string, so the answer cut from the
    shorter tokens is the answer cut from all of them; a token after it is never checked."""
    tokenizer = tokenizers[name]
    if name == "null":
        prompt, generated = [5, 17, 42], [8, 98, 12, 98, 1, 31, 31, 1, 4, 1, 5, 9] * 3
        stops = [["31 1"], ["1 4 1", "9 8 98"], ["8 98 12 98 1 31 31 1 4 1 5 9 8"]][STOPS.index(stops) - 1]
    else:
        prompt, generated = tokenizer.tokenize("Hallo 🙂 Welt:"), tokenizer.tokenize(STREAMED)
    checks = StopStrings(tokenizer, [prompt, prompt], stops)
    live = [True, False]  # the second sequence is past its end: never checked
    hits = [checks.hits([t, t], live) for t in generated]
    assert all(not h[1] for h in hits)
    k = [h[0] for h in hits].index(True) + 1
    assert k == _first_stop(tokenizer, prompt, generated, stops) < len(generated)
    whole = Generation(prompt + generated, len(prompt), [])
    assert _stop_text(tokenizer, Generation(prompt + generated[:k], len(prompt), []), stops) == \
        _stop_text(tokenizer, whole, stops)


def test_a_token_the_tokenizer_cannot_decode_leaves_the_sequence_running():
    """The check only saves steps: where decoding raises (the answer will report it) or the window
    never completes a stop string, the sequence is not ended early."""
    class Broken:
        def detokenize(self, ids):
            if 7 in ids:
                raise KeyError(7)
            return NULL.detokenize(ids)

    checks = StopStrings(Broken(), [[1, 2]], ["3 4"])
    assert [checks.hits([t], [True])[0] for t in (3, 7, 3, 4)] == [False] * 4 and checks.off == [True]
    checks = StopStrings(NULL, [[1, 2]], ["3 4"])
    assert [checks.hits([t], [True])[0] for t in (3, 5, 3, 4)] == [False, False, False, True]


def test_stop_strings_must_be_non_empty_strings():
    with pytest.raises(ValueError, match="stop_strings must be non-empty strings"):
        SamplingParams(stop_strings=("",)).check()
