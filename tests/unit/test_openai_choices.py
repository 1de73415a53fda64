"""``n`` completions per prompt on the OpenAI-compatible routes (Flask's test client): choice
``i * n + j`` is prompt i's j-th sample, drawn independently in one batch (the engine's own result for
each prompt repeated n times), greedy gives n equal choices (as OpenAI and vLLM do), usage counts each
prompt once; streamed choices keep the same indices; ``best_of`` returns the n best of its samples
(ranked by hand here)."""

import json

import pytest

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.sampling import SamplingParams
from tests.inference_helpers import VOCAB, served_gpt

pytest.importorskip("flask")
PROMPTS = ["5 17 42 8", "3 1 4 1 5 9 2 6 5"]


@pytest.fixture(scope="module")
def served():
    return served_gpt()


def ids(text):
    return [int(t) for t in text.split()]


def test_n_seeded_samples_per_prompt_indexed_as_openai(served):
    client, engine = served
    body = client.post("/v1/completions", json={"prompt": PROMPTS, "n": 3, "best_of": 3, "max_tokens": 6,
                                                "temperature": 1.5, "seed": 4, "echo": True}).get_json()
    batch = [ids(p) for p in PROMPTS for _ in range(3)]
    want = engine.generate(batch, SamplingParams(tokens_to_generate=6, temperature=1.5, random_seed=4))
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for choice, g, prompt in zip(body["choices"], want, [p for p in PROMPTS for _ in range(3)]):
        assert choice["text"] == prompt + "".join(f" {t}" for t in g.generated)  # echo: its own prompt
    assert len({c["text"] for c in body["choices"][:3]}) > 1  # independent samples, not one copied
    assert body["usage"]["prompt_tokens"] == sum(len(ids(p)) for p in PROMPTS)
    assert body["usage"]["completion_tokens"] == sum(len(g.generated) for g in want)


def test_greedy_n_gives_n_equal_choices(served):
    client, _ = served
    one = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}).get_json()
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPTS[0]}], "n": 2,
                                                     "max_tokens": 5, "temperature": 0}).get_json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == body["choices"][1]["message"]
    body = client.post("/v1/completions", json={"prompt": PROMPTS[0], "n": 4, "max_tokens": 5,
                                                "temperature": 0}).get_json()
    assert [c["text"] for c in body["choices"]] == [one["choices"][0]["text"]] * 4


def test_streamed_n_choices_keep_their_indices(served):
    client, _ = served
    request = {"prompt": PROMPTS, "n": 2, "max_tokens": 6, "temperature": 1.0, "top_k": 5, "seed": 9}
    want = {c["index"]: c["text"] for c in client.post("/v1/completions", json=request).get_json()["choices"]}
    body = client.post("/v1/completions", json={**request, "stream": True}).get_data(as_text=True)
    got = {}
    for block in body.split("\n\n"):
        if block.startswith("data: {"):
            for c in json.loads(block[len("data: "):])["choices"]:
                got[c["index"]] = got.get(c["index"], "") + c["text"]
    assert got == want and len(got) == 4


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_log_prob(served):
    """best_of 4, n 2: the engine's 4 seeded samples per prompt ranked by hand (the sum of the generated
    tokens' log-probs), the best 2 returned best first, numbered as OpenAI numbers n choices."""
    client, engine = served
    request = {"prompt": PROMPTS, "n": 2, "best_of": 4, "max_tokens": 6, "temperature": 1.5, "seed": 4, "logprobs": 0}
    body = client.post("/v1/completions", json=request).get_json()
    batch = [ids(p) for p in PROMPTS for _ in range(4)]
    candidates = engine.generate(batch, SamplingParams(tokens_to_generate=6, temperature=1.5, random_seed=4))
    want, first_two = [], []
    for p in range(len(PROMPTS)):
        group = candidates[p * 4:(p + 1) * 4]
        sums = [sum(g.log_probs[g.prompt_length - 1:]) for g in group]
        ranked = sorted(range(4), key=lambda k: sums[k], reverse=True)
        want += [group[k] for k in ranked[:2]]
        first_two.append(sorted(ranked[:2]) == [0, 1])
    assert not all(first_two)  # the ranking matters here: returning the first n samples would fail
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [ids(c["text"]) for c in body["choices"]] == [g.generated for g in want]
    for choice, g in zip(body["choices"], want):
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(g.log_probs[g.prompt_length - 1:], abs=1e-6)
    assert body["usage"]["prompt_tokens"] == sum(len(ids(p)) for p in PROMPTS)
    assert body["usage"]["completion_tokens"] == sum(len(g.generated) for g in want)  # the returned only


def test_best_of_ranks_the_text_returned_before_a_stop_string(served):
    """A stop string cuts a candidate: only the tokens returned count in its cumulative log-prob."""
    from megatron_lite.inference.api_openai import _best, _choice, parse_completion

    _, engine = served
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    job = parse_completion({"prompt": PROMPTS[0], "n": 1, "best_of": 3, "max_tokens": 8, "seed": 5,
                            "stop": " 3"}, tokenizer)
    results = engine.generate(job.prompts, job.params)
    candidates = [_choice(job, i, r, tokenizer) for i, r in enumerate(results)]
    for (choice, count, score), r in zip(candidates, results):
        returned = len(ids(choice["text"]))
        assert count == returned and score == pytest.approx(sum(r.log_probs[r.prompt_length - 1:][:returned]))
    assert any(c[0]["finish_reason"] == "stop" and c[1] < 8 for c in candidates)  # a stop string did cut one
    best = max(range(3), key=lambda k: candidates[k][2])
    assert [c[0]["text"] for c in _best(job, candidates)] == [candidates[best][0]["text"]]


@pytest.mark.parametrize("body, message", [
    ({"prompt": "1", "n": 3, "best_of": 2}, "best_of must be at least n (3), got 2"),
    ({"prompt": "1", "best_of": 0}, "best_of must be at least 1"),
    ({"prompt": ["1", "2", "3"], "n": 2, "best_of": 50}, "best_of x prompts is 150; at most 128"),
    ({"prompt": "1", "best_of": 2, "stream": True}, "best_of > n cannot be streamed"),
    ({"prompt": "1", "n": 0}, "n must be at least 1"),
    ({"prompt": ["1", "2", "3"], "n": 50}, "n x prompts is 150; at most 128 completions per request"),
])
def test_bad_n_gets_one_json_400(served, body, message):
    r = served[0].post("/v1/completions", json=body)
    assert r.status_code == 400 and r.get_json()["error"]["message"].startswith(message)
