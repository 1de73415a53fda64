"""``"stream": true`` on /v1/completions and /v1/chat/completions (Flask's test client, raw HTTP
bodies): the text of the server-sent events, joined, is the non-streamed answer of the same greedy or
seeded request, and so are their ``logprobs`` entries; no part of a stop string and no broken UTF-8 character is ever sent; a client that
leaves mid-stream does not leave the engine half-way (every rank must run every step)."""

import json

import pytest

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.api_megatron import continuation_text
from megatron_lite.inference.api_openai import _stop_text, openai_response, parse_completion
from megatron_lite.inference.api_stream import CONTEXT, TextStream, safe_end, stream_events
from megatron_lite.inference.engine import Generation, InferenceEngine, Step
from megatron_lite.inference.sampling import SamplingParams
from megatron_lite.inference.server import Runner, create_app
from tests.inference_helpers import (
    GPT2_TOKENIZER,
    MAX_LEN,
    VOCAB,
    build_model,
    tiny_sentencepiece,
)

pytest.importorskip("flask")
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}"
PROMPTS = ["5 17 42 8", "3 1 4 1 5 9 2 6 5"]


class CountingRunner(Runner):
    """A one-process runner that remembers the step generators it handed out."""

    def __init__(self, engine):
        super().__init__(engine)
        self.handed = []

    def stream(self, prompts, params):
        steps = super().stream(prompts, params)
        self.handed.append(steps)
        return steps


@pytest.fixture(scope="module")
def app():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    engine = InferenceEngine(build_model("gpt"), vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod)
    runner = CountingRunner(engine)
    flask_app = create_app(runner, tokenizer, chat_template=TEMPLATE)
    flask_app.runner = runner
    return flask_app


def events(response) -> list:
    """The events of a streamed answer: JSON chunks, then the string "[DONE]"."""
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    body = response.get_data(as_text=True)
    assert body.endswith("\n\n")
    out = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def joined(chunks, chat=False) -> dict[int, str]:
    texts = {}
    for c in chunks:
        for choice in c["choices"]:
            piece = choice["delta"].get("content", "") if chat else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


@pytest.mark.parametrize("extra", [{"temperature": 0}, {"temperature": 1.2, "top_k": 8, "seed": 3},
                                   {"temperature": 0, "stop": ["1", "9 3"], "echo": True}])
def test_streamed_completions_join_to_the_answer(app, extra):
    client = app.test_client()
    request = {"prompt": PROMPTS, "max_tokens": 12, **extra}
    want = client.post("/v1/completions", json=request).get_json()
    got = events(client.post("/v1/completions", json={**request, "stream": True}))
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] and "usage" not in c for c in chunks)
    assert joined(chunks) == {c["index"]: c["text"] for c in want["choices"]}
    for choice in want["choices"]:  # each choice's finish_reason comes once, in its last chunk
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + [choice["finish_reason"]]
    if "stop" in extra:
        assert any(c["finish_reason"] == "stop" for c in want["choices"])  # the test holds a stop string


def test_a_stop_string_ends_the_text_where_generation_meets_it(app):
    """Greedy, the prompts continue ' 98 12 ...' and ' 31 31 ...'. The token '98' completes the stop string
    '8', so the text is ' 9', streamed or not; '98 12' begins earlier but completes only at the next token,
    which the engine generates on past the stop (it was the non-streamed cut, ' ', so the streamed pieces
    did not join to the answer). Likewise '1' in '31' ends the second choice before '31 31'."""
    client = app.test_client()
    request = {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "stop": ["98 12", "8", "31 31", "1"]}
    plain = client.post("/v1/completions", json={**request, "stop": None}).get_json()["choices"]
    assert [c["text"][:6] for c in plain] == [" 98 12", " 31 31"]  # what the stop strings are chosen for
    want = client.post("/v1/completions", json={**request, "logprobs": 0}).get_json()
    assert [c["text"] for c in want["choices"]] == [" 9", " 3"]
    assert [c["finish_reason"] for c in want["choices"]] == ["stop", "stop"]
    # the tokens that reach the cut, as their text in the answer (" 98 12 ..."; test_logprob_token_texts.py)
    assert [c["logprobs"]["tokens"] for c in want["choices"]] == [[" 98"], [" 31"]]
    assert want["usage"]["completion_tokens"] == 2
    got = events(client.post("/v1/completions", json={**request, "stream": True}))
    assert joined(got[:-1]) == {0: " 9", 1: " 3"}


def test_streamed_chat_sends_the_role_then_content_deltas(app):
    client = app.test_client()
    request = {"messages": [{"role": "user", "content": "5 17"}], "max_tokens": 9, "temperature": 0, "stop": "4"}
    want = client.post("/v1/chat/completions", json=request).get_json()
    got = events(client.post("/v1/chat/completions", json={**request, "stream": True}))
    assert got[-1] == "[DONE]" and got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in got[:-1])
    assert joined(got[:-1], chat=True) == {0: want["choices"][0]["message"]["content"]}
    assert got[-2]["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]


def test_include_usage_adds_a_last_chunk_with_the_usage(app):
    client = app.test_client()
    request = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "stop": ["2"]}
    want = client.post("/v1/completions", json=request).get_json()["usage"]
    got = events(client.post("/v1/completions", json={**request, "stream": True,
                                                       "stream_options": {"include_usage": True}}))
    assert got[-2] == {**got[0], "choices": [], "usage": want} and got[-1] == "[DONE]"
    assert all(c["usage"] is None for c in got[:-2])


def streamed_logprobs(chunks, chat=False) -> dict[int, dict]:
    """Each choice's logprobs entries, its chunks' joined (chat: the content list)."""
    joined_lp = {}
    for c in chunks:
        for choice in c["choices"]:
            lp = choice["logprobs"]
            if lp is None:
                assert chat and choice["delta"].get("role") == "assistant"  # only chat's first chunk has none
                continue
            mine = joined_lp.setdefault(choice["index"], {})
            for key, value in lp.items():
                mine[key] = mine.get(key, []) + (value or [])
    return joined_lp


@pytest.mark.parametrize("extra", [{"temperature": 0, "logprobs": 3}, {"temperature": 0, "logprobs": 0, "echo": True},
                                   {"temperature": 1.2, "top_k": 8, "seed": 3, "n": 2, "logprobs": 2},
                                   {"temperature": 0, "logprobs": 1, "stop": ["1", "9 3"], "echo": True},
                                   {"temperature": 0, "logprobs": 2, "echo": True, "max_tokens": 0}])
def test_streamed_completion_logprobs_join_to_the_answers(app, extra):
    """Each chunk carries the entries of the tokens whose text it completes; with echo, the prompt's
    chunk carries the prompt's. Joined, they are the non-streamed answer's (the same numbers)."""
    client = app.test_client()
    request = {"prompt": PROMPTS, "max_tokens": 12, **extra}
    want = client.post("/v1/completions", json=request).get_json()
    chunks = events(client.post("/v1/completions", json={**request, "stream": True}))[:-1]
    got = streamed_logprobs(chunks)
    assert len(got) == len(want["choices"])
    for choice in want["choices"]:
        lp = {key: value or [] for key, value in choice["logprobs"].items()}
        assert got[choice["index"]] == lp and len(lp["tokens"]) > 0
    assert joined(chunks) == {c["index"]: c["text"] for c in want["choices"]}
    for c in chunks:  # a chunk's entries are the tokens of its own text
        lp = c["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == c["choices"][0]["text"] or "stop" in extra
    if extra.get("max_tokens") != 0:  # entries come as the tokens do, not all in the last chunk
        assert sum(1 for c in chunks if c["choices"][0]["logprobs"]["tokens"]) > len(want["choices"]) * 2


def test_streamed_chat_logprobs_join_to_the_answers(app):
    client = app.test_client()
    request = {"messages": [{"role": "user", "content": "5 17"}], "max_tokens": 9, "temperature": 0,
               "logprobs": True, "top_logprobs": 3, "n": 2}
    want = client.post("/v1/chat/completions", json=request).get_json()
    chunks = events(client.post("/v1/chat/completions", json={**request, "stream": True}))[:-1]
    got = streamed_logprobs(chunks, chat=True)
    assert {i: g["content"] for i, g in got.items()} == {c["index"]: c["logprobs"]["content"] for c in want["choices"]}
    assert all(len(e["top_logprobs"]) == 3 for g in got.values() for e in g["content"]) and len(got[0]["content"]) == 9


def test_the_engine_hands_out_each_steps_log_probs_only_when_asked(app):
    """``step_log_probs``: every step's log-probs, joined per sequence, are the final ones (the same numbers);
    without it the steps carry none."""
    engine = app.runner.engine
    prompts = [[5, 17, 42, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    for asked in (True, False):
        steps = engine.stream(prompts, SamplingParams(tokens_to_generate=7, temperature=1.1, random_seed=2,
                                                      top_n_logprobs=2, step_log_probs=asked))
        values, tops = [[], []], [[], []]
        while True:
            try:
                step = next(steps)
            except StopIteration as end:
                results = end.value
                break
            if not asked:
                assert step.log_probs is None and step.top_log_probs is None
                continue
            assert step.start == len(values[0])
            for i in range(2):
                values[i] += step.log_probs[i]
                tops[i] += step.top_log_probs[i]
        if asked:
            for i, result in enumerate(results):
                assert values[i][:len(result.log_probs)] == result.log_probs
                assert tops[i][:len(result.log_probs)] == result.top_log_probs


def test_a_stop_string_is_never_sent_in_part():
    """Text that could start the stop string '4 1 5' waits ('4', then '4 1') until the next token shows
    whether the whole stop string follows: then the text ends before it, else the held text goes out."""
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    stream = TextStream(tokenizer, [3, 1], ["4 1 5"])
    pieces = [stream.push(t) for t in [9, 4, 1, 5, 6]]
    assert pieces == [" 9", " ", "", "", ""] and stream.stopped
    stream = TextStream(tokenizer, [3], ["4 1 5"])
    assert [stream.push(t) for t in [4, 1, 2]] == [" ", "", "4 1 2"] and not stream.stopped
    assert safe_end("ab 4 1", ["4 1 5"]) == 3 and safe_end("x\ufffd\ufffd", []) == 1


def test_a_character_split_over_tokens_is_sent_whole():
    tokenizer = build_tokenizer(**GPT2_TOKENIZER)
    text = " 龘𝔘 end"  # byte-level BPE: each of the two characters is two tokens of partial UTF-8
    stream = TextStream(tokenizer, tokenizer.tokenize("Hi"), [])
    pieces = [stream.push(t) for t in tokenizer.tokenize(text)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 2  # the half characters waited


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Byte-level BPE (GPT-2's: characters split over tokens), SentencePiece (word starts joined in
    context; byte fallback for what its tiny vocabulary lacks) and the NullTokenizer (ids)."""
    return {"gpt2": build_tokenizer(**GPT2_TOKENIZER),
            "sentencepiece": tiny_sentencepiece(str(tmp_path_factory.mktemp("spm")), [STREAMED]),
            "null": build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)}


STREAMED = "Der naïve Bär aß 日本語 mit 🙂🚀 und 龘𝔘 am Ende, café."
STOPS = [[], ["日本語 mit 🙂"], ["🚀 und", "ß 日"], ["Ende, c", "Bär aß 日本語 mit 🙂🚀 und 龘𝔘 am Ende, caf"]]


def stream_text(tokenizer, prompt, generated, stops):
    """The pieces a TextStream sends for ``generated`` after ``prompt``, and the engine's result."""
    stream = TextStream(tokenizer, prompt, stops)
    pieces = [stream.push(t) for t in generated]
    return pieces + [stream.finish(Generation(prompt + generated, len(prompt), []))], stream


@pytest.mark.parametrize("name", ["gpt2", "sentencepiece", "null"])
@pytest.mark.parametrize("stops", STOPS)
def test_incremental_pieces_join_to_the_non_streamed_text(tokenizers, name, stops):
    """Streamed pieces join to the non-streamed answer's text (the whole continuation decoded once, cut
    at the first stop string a token completes) where tokens split characters and stop strings
    straddle tokens; no piece holds part of a character or of a stop string."""
    tokenizer = tokenizers[name]
    if name == "null":
        prompt, generated = [5, 17, 42], [8, 98, 12, 98, 1, 31, 31, 1, 4, 1, 5, 9] * 3
        stops = [[], ["31 1"], ["1 4 1", "9 8 98"], ["8 98 12 98 1 31 31 1 4 1 5 9 8"]][STOPS.index(stops)]
    else:
        prompt, generated = tokenizer.tokenize("Hallo 🙂 Welt:"), tokenizer.tokenize(STREAMED)
    assert len(generated) > len(STREAMED) // 4  # several tokens per word, and per character for some
    pieces, stream = stream_text(tokenizer, prompt, generated, stops)
    want, stopped = _stop_text(tokenizer, Generation(prompt + generated, len(prompt), []), stops)
    assert "".join(pieces) == want and stream.stopped == stopped == bool(stops)
    assert not any("\ufffd" in p for p in pieces)
    assert not any(s[:k] in p for p in pieces for s in stops for k in range(2, len(s) + 1) if s[:k] not in want)
    if not stops:
        assert sum(1 for p in pieces[:-1] if p) > len(pieces) // 3  # sent as the tokens came, not all at the end


class CountingTokenizer:
    """A tokenizer that counts its decode calls and the tokens each one decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def detokenize(self, ids):
        self.sizes.append(len(ids))
        return self.tokenizer.detokenize(ids)


@pytest.mark.parametrize("name", ["gpt2", "null"])
def test_a_step_decodes_a_bounded_window_however_long_the_answer(tokenizers, name):
    """Each token costs two decodes of at most CONTEXT tokens plus those of a character still incomplete
    (four bytes at most): the work per step does not grow with the answer (it decoded the whole
    text, twice, at every step)."""
    tokenizer = tokenizers[name]
    text = " ".join(map(str, range(98))) if name == "null" else STREAMED * 8
    generated, prompt = tokenizer.tokenize(text), tokenizer.tokenize("3 1 4" if name == "null" else "Hi 🙂")
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting, prompt, ["never in the text"])
    for i, token in enumerate(generated):
        before = len(counting.sizes)
        stream.push(token)
        assert len(counting.sizes) - before <= 2
        assert max(counting.sizes[before:]) <= CONTEXT + 4, f"token {i} of {len(generated)}"
    whole = continuation_text(tokenizer, Generation(prompt + generated, len(prompt), []))
    assert len(generated) > 90 and whole.startswith(stream.sent) and len(stream.sent) > len(whole) - 20


def scripted_steps(prompt, generated):
    """An engine's steps for one sequence that generates ``generated`` (made-up log-probs, one best
    token each); returns its Generation."""
    values = [-0.1 - (i % 7) / 3 for i in range(len(prompt) + len(generated) - 1)]
    tops = [[(t, v)] for t, v in zip(prompt[1:] + generated, values)]
    for n, token in enumerate(generated):
        step, lo = Step([token]), (0 if n == 0 else len(prompt) + n - 1)
        step.start, step.log_probs, step.top_log_probs = lo, [values[lo:len(prompt) + n]], [tops[lo:len(prompt) + n]]
        yield step
    return [Generation(prompt + generated, len(prompt), values, "length", tops)]


@pytest.mark.parametrize("name", ["gpt2", "sentencepiece"])
@pytest.mark.parametrize("stops", STOPS + [[" mit"]])
def test_streamed_logprobs_join_to_the_answers_where_characters_split(tokenizers, name, stops):
    """Through the events generator with logprobs: text and entries joined per choice are the
    non-streamed answer's where tokens split characters and stop strings straddle tokens, and
    apart from the last chunk's whole-text decode every decode is of a few tokens."""
    tokenizer = tokenizers[name]
    prompt, generated = tokenizer.tokenize("Hallo 🙂 Welt:"), tokenizer.tokenize(STREAMED * 3)
    request = {"prompt": prompt, "max_tokens": len(generated), "logprobs": 1, "stop": stops or None}
    steps = scripted_steps(prompt, generated)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            results = end.value
            break
    want = openai_response(parse_completion(request, tokenizer), results, tokenizer, "m")["choices"][0]
    counting = CountingTokenizer(tokenizer)
    job = parse_completion({**request, "stream": True}, tokenizer)
    chunks = [json.loads(e[len("data: "):]) for e in stream_events(job, scripted_steps(prompt, generated), counting,
                                                                       "m", None) if e != "data: [DONE]\n\n"]
    assert joined(chunks) == {0: want["text"]} and streamed_logprobs(chunks)[0] == want["logprobs"]
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= (3 if stops else len(generated) // 3)
    assert sum(size > CONTEXT + 4 for size in counting.sizes) <= 2  # the last chunk's decode of the whole text
    if stops:  # the entries before a stop string hold every byte of the text's last character
        covered = prompt + generated[:len(want["logprobs"]["tokens"])]
        assert continuation_text(tokenizer, Generation(covered, len(prompt), []))[:len(want["text"])] == want["text"]


def test_a_client_leaving_mid_stream_still_runs_every_step(app):
    client = app.test_client()
    request = {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "stream": True}
    response = client.post("/v1/completions", json=request, buffered=False)
    first = next(iter(response.response))
    assert first.startswith(b"data: ")
    response.close()  # what the server does when the client's socket is gone
    steps = app.runner.handed[-1]
    assert steps.gi_frame is None  # the engine's generator ran to its end: no rank waits on a collective
    assert next(iter(events(client.post("/v1/completions", json=request))))["choices"]  # and serving goes on


def test_an_engine_error_mid_stream_is_an_error_event(app, monkeypatch):
    engine = app.runner.engine
    healthy = engine.forward
    monkeypatch.setattr(engine, "forward", lambda *a, **k: healthy(*a, **k).fill_(float("nan")))
    got = events(app.test_client().post("/v1/completions", json={"prompt": "1 2", "max_tokens": 3, "stream": True}))
    assert got[-1]["error"]["message"].startswith("NonFiniteLogitsError: the model's logits hold NaN or inf")


@pytest.mark.parametrize("body, message", [
    ({"prompt": "1", "stream": True, "n": 2, "best_of": 3}, "best_of > n cannot be streamed"),
    ({"prompt": "1", "stream_options": {"include_usage": True}}, "stream_options needs stream=true"),
    ({"prompt": "1", "stream": True, "stream_options": {"usage": True}}, "stream_options must be an object"),
    ({"prompt": "1", "stream": "yes"}, "stream must be a boolean"),
    ({"prompt": " ".join(["1"] * 95), "stream": True, "max_tokens": 4}, "prompt has 95 tokens + max_tokens 4, more than the model's context of 96"),
])
def test_bad_stream_requests_get_one_json_400(app, body, message):
    r = app.test_client().post("/v1/completions", json=body)
    assert r.status_code == 400 and r.get_json()["error"]["message"].startswith(message)


@pytest.mark.parametrize("stops", [["\ufffd"], ["\ufffd", "x"], ["a\ufffd"]])
def test_a_stop_string_of_replacement_characters_is_not_met_by_a_character_still_incomplete(stops):
    """The non-streamed answer, whose whole text held a stop, looked for the first prefix of the answer
    whose text holds it, where a character split over two tokens decodes as U+FFFD until its last byte
    comes: a stop string holding U+FFFD met that and cut the text there ("é"), while the stream,
    which waits for the whole character, sent "é🙂 a" up to the U+FFFD that stays (a lone second
    half of 🙂 at the end). The prefixes now leave an incomplete trailing character out, as the
    stream does, so both answer "é🙂 a" (or "é🙂 " for "a\ufffd")."""
    tokenizer = build_tokenizer(**GPT2_TOKENIZER)
    prompt, answer = tokenizer.tokenize("x"), tokenizer.tokenize("é🙂 a")  # 🙂's bytes span two tokens
    assert tokenizer.detokenize(answer[:2]) == "é\ufffd"
    generated = answer + answer[2:3]  # then 🙂's second half alone: U+FFFDs that stay
    result = Generation(prompt + generated, len(prompt), [0.0] * (len(prompt) + len(generated) - 1))
    stream = TextStream(tokenizer, prompt, stops)
    streamed = "".join(stream.push(t) for t in generated) + stream.finish(result)
    assert streamed == ("é🙂 " if stops == ["a\ufffd"] else "é🙂 a") and stream.stopped
    assert _stop_text(tokenizer, result, stops) == (streamed, True)
