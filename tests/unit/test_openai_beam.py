"""``use_beam_search`` on the OpenAI-compatible routes (Flask's test client): the choices are the
hypotheses of Megatron's ``PUT /api`` beam search on the same prompt, best first, the ``n`` best of
``best_of`` beams per prompt; over two tokens of a tiny vocabulary they equal an exhaustive search;
``logprobs`` are the hypotheses' own log-probs (they add up to the score); the combinations beam
search cannot honour are refused with HTTP 400 naming the field."""

import pytest

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.api_openai import parse_chat, parse_completion
from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.fields import RequestError
from megatron_lite.inference.sampling import SamplingParams
from megatron_lite.inference.server import Runner, create_app
from tests.inference_helpers import CHAT_TEMPLATE as TEMPLATE
from tests.inference_helpers import MAX_LEN, VOCAB, served_gpt
from tests.unit.test_beam_search import SMALL, exhaustive, small_model  # noqa: F401 - small_model: a fixture

pytest.importorskip("flask")
PROMPTS = ["5 17 42 8", "3 1 4 1 5 9 2 6 5"]


@pytest.fixture(scope="module")
def served():
    return served_gpt()


def ids(text):
    return [int(t) for t in text.split()]


def test_beam_choices_are_megatrons_api_hypotheses_best_first(served):
    client, engine = served
    api = client.put("/api", json={"prompts": [PROMPTS[0]], "beam_width": 3, "tokens_to_generate": 6,
                                   "length_penalty": 0.5}).get_json()
    body = client.post("/v1/completions", json={"prompt": PROMPTS[0], "use_beam_search": True, "n": 3,
                                                "max_tokens": 6, "length_penalty": 0.5, "temperature": 0}).get_json()
    assert [PROMPTS[0] + c["text"] for c in body["choices"]] == api["text"]
    assert len(set(api["text"])) == 3 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    want = engine.generate([ids(PROMPTS[0])], SamplingParams(tokens_to_generate=6, beam_width=3, length_penalty=0.5))
    assert [c["finish_reason"] for c in body["choices"]] == [w.finish_reason for w in want]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": sum(len(w.generated) for w in want),
                             "total_tokens": 4 + sum(len(w.generated) for w in want)}
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPTS[0]}],
                                                     "use_beam_search": True, "n": 2, "max_tokens": 6}).get_json()
    prompt = ids(PROMPTS[0]) + [7]  # the template's generation prompt
    want = engine.generate([prompt], SamplingParams(tokens_to_generate=6, beam_width=2))
    assert [c["message"]["content"] for c in chat["choices"]] == ["".join(f" {t}" for t in w.generated) for w in want]


def test_n_best_of_best_of_beams_per_prompt_numbered_as_openai(served):
    """Two prompts, best_of 4 beams, n 2: each prompt's beam search on its own, its two best returned
    (choice i * n + j), usage counting the returned tokens; logprobs add up to each beam's score
    (length penalty 1: the summed log-probs over the generated length)."""
    client, engine = served
    body = client.post("/v1/completions", json={"prompt": PROMPTS, "use_beam_search": True, "n": 2, "best_of": 4,
                                                "max_tokens": 5, "logprobs": 2, "echo": True}).get_json()
    want = [w for p in PROMPTS for w in engine.generate([ids(p)], SamplingParams(tokens_to_generate=5, beam_width=4))[:2]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice, w, prompt in zip(body["choices"], want, [p for p in PROMPTS for _ in range(2)]):
        assert choice["text"] == prompt + "".join(f" {t}" for t in w.generated)
        values = choice["logprobs"]["token_logprobs"]
        assert values[0] is None and len(values) == len(w.tokens)
        assert sum(values[len(w.tokens) - len(w.generated):]) / len(w.generated) == pytest.approx(w.score, abs=1e-4)
        assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == sum(len(w.generated) for w in want)
    assert body["usage"]["prompt_tokens"] == sum(len(ids(p)) for p in PROMPTS)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beam_search_over_two_tokens_equals_an_exhaustive_search(small_model, length_penalty):  # noqa: F811
    """Every first token kept (vocab - 1 beams), two new tokens: the choices are the exhaustive search's
    best sequences, in its order (test_beam_search's reference, through the OpenAI route)."""
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=SMALL - 1)
    engine = InferenceEngine(small_model, vocab_size=SMALL, max_sequence_length=MAX_LEN, eod=SMALL - 1)
    client = create_app(Runner(engine), tokenizer).test_client()
    prompt = [3, 1, 8, 4]
    body = client.post("/v1/completions", json={"prompt": prompt, "use_beam_search": True, "n": SMALL - 1,
                                                "max_tokens": 2, "length_penalty": length_penalty}).get_json()
    want = exhaustive(small_model, prompt, SMALL - 1, length_penalty)[:SMALL - 1]
    # the stop token (the end of document) adds no text, as sampling's answers (tests/unit/test_openai_end_of_document.py)
    texts = [tokenizer.detokenize(seq[:-1] if seq[-1] == SMALL - 1 else seq) for _, seq in want]
    assert [" ".join(map(str, prompt)) + c["text"] for c in body["choices"]] == texts
    assert [c["finish_reason"] for c in body["choices"]] == ["stop" if s[-1] == SMALL - 1 else "length" for _, s in want]


def test_a_stop_string_cuts_each_beam(served):
    client, engine = served
    want = engine.generate([ids(PROMPTS[0])], SamplingParams(tokens_to_generate=6, beam_width=2))
    stop = f" {want[0].generated[2]}"
    body = client.post("/v1/completions", json={"prompt": PROMPTS[0], "use_beam_search": True, "n": 2,
                                                "max_tokens": 6, "stop": stop}).get_json()
    for choice, w in zip(body["choices"], want):
        text = "".join(f" {t}" for t in w.generated)
        cut = text.find(stop)
        assert choice["text"] == (text[:cut] if cut >= 0 else text)
        assert choice["finish_reason"] == ("stop" if cut >= 0 or w.finish_reason == "stop" else "length")
    assert body["choices"][0]["finish_reason"] == "stop" and len(body["choices"][0]["text"]) < len(stop) * 2


@pytest.mark.parametrize("extra, message", [
    ({"stream": True}, "use_beam_search cannot be streamed"),
    ({"temperature": 0.7}, "temperature does not apply to beam search (use_beam_search); drop it or send 0.0 or 1.0"),
    ({"top_p": 0.9}, "top_p does not apply to beam search"),
    ({"top_k": 5}, "top_k does not apply to beam search"),
    ({"seed": 3}, "seed does not apply to beam search (use_beam_search); drop it or send null"),
    ({"frequency_penalty": 0.5}, "frequency_penalty does not apply to beam search"),
    ({"presence_penalty": -1}, "presence_penalty does not apply to beam search"),
    ({"logit_bias": {"5": 3}}, "logit_bias does not apply to beam search"),
    ({"n": 3, "best_of": 2}, "best_of must be at least n (3), got 2"),
    ({"n": 100}, "n is the beam width with use_beam_search: at most 99, got 100"),
    ({"best_of": 120}, "best_of is the beam width with use_beam_search: at most 99, got 120"),
    ({"max_tokens": 0, "echo": True}, "use_beam_search needs max_tokens >= 1"),
    ({"use_beam_search": "yes"}, "use_beam_search must be a boolean"),
    ({"length_penalty": float("inf")}, "length_penalty must be a finite number"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty applies to beam search only"),
])
def test_combinations_beam_search_cannot_honour_are_refused(served, extra, message):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    body = {"prompt": PROMPTS[0], "use_beam_search": True, "n": 2} | extra
    with pytest.raises(RequestError) as err:
        parse_completion(body, tokenizer)
    assert str(err.value).startswith(message)
    client, _ = served
    if extra.get("length_penalty") != float("inf"):
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 400 and answer.get_json()["error"]["message"].startswith(message)


@pytest.mark.parametrize("extra, message", [
    ({"stream": True}, "use_beam_search cannot be streamed"),
    ({"temperature": 2}, "temperature does not apply to beam search"),
    ({"n": 100}, "n is the beam width with use_beam_search: at most 99"),
])
def test_chat_refuses_the_same_combinations(extra, message):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    body = {"messages": [{"role": "user", "content": "1"}], "use_beam_search": True} | extra
    with pytest.raises(RequestError, match=f"^{message}"):
        parse_chat(body, tokenizer, TEMPLATE, MAX_LEN)


def test_neutral_sampling_values_are_accepted_with_beam_search():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    job = parse_completion({"prompt": PROMPTS[0], "use_beam_search": True, "n": 2, "temperature": 1, "top_p": 1,
                            "top_k": -1, "seed": None, "presence_penalty": 0, "logit_bias": {}, "max_tokens": 3,
                            "length_penalty": 0.7}, tokenizer)
    assert job.beam and job.prompts == [ids(PROMPTS[0])]
    assert (job.params.beam_width, job.params.length_penalty, job.params.tokens_to_generate) == (2, 0.7, 3)
    assert not parse_completion({"prompt": PROMPTS[0], "use_beam_search": False}, tokenizer).params.beam_width
