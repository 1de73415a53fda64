"""OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``: the formula against numbers
worked out by hand, the engine's greedy generation against a step-by-step reference that applies the
formula in plain Python to the model's full-prefix logits (prompts of different lengths: a prompt's
own tokens are never counted), and the request fields' checks (one JSON 400 naming the field)."""

import pytest
import torch

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.sampling import SamplingParams, adjust_logits, sample_or_mark
from megatron_lite.inference.server import Runner, create_app
from tests.inference_helpers import MAX_LEN, VOCAB, build_model, prompts


def test_the_formula_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [0.0, -1.0, 4.0, 2.0]])
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 1.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias=((0, 2.0), (3, -1.5)))
    # row 0: 1 + 2 | 2 - 0.5 - 0.25 | 3 - 1.5 - 0.25 | 0.5 - 1.5;  row 1: 0 - 1 - 0.25 + 2 | -1 | 4 | 2 - 0.5 - 0.25 - 1.5
    want = torch.tensor([[3.0, 1.25, 1.25, -1.0], [0.75, -1.0, 4.0, -0.25]])
    torch.testing.assert_close(adjust_logits(logits, params, counts), want)
    greedy = SamplingParams(top_k=1, frequency_penalty=0.5, presence_penalty=0.25, logit_bias=((0, 2.0), (3, -1.5)))
    assert sample_or_mark(logits, greedy, None, counts).tolist() == [0, 2]  # the argmax after the penalties
    assert sample_or_mark(logits, SamplingParams(top_k=1), None, counts).tolist() == [2, 2]


def _reference(model_engine, prompt, params, new):
    """Greedy decoding with the penalties applied by hand to full-prefix logits (no cache)."""
    seq, generated = list(prompt), []
    for _ in range(new):
        logits = model_engine.forward(torch.tensor([seq]))[0, -1].tolist()
        bias = dict(params.logit_bias)
        scores = [v - params.frequency_penalty * generated.count(t) - params.presence_penalty * (t in generated)
                  + bias.get(t, 0.0) for t, v in enumerate(logits)]
        token = max(range(len(scores)), key=scores.__getitem__)
        seq.append(token)
        generated.append(token)
    return seq


def test_greedy_generation_with_penalties_follows_the_hand_computation():
    engine = InferenceEngine(build_model("gpt"), vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=None)
    batch = prompts(3, lengths=(5, 9, 7))
    plain = engine.generate(batch, SamplingParams(tokens_to_generate=12, top_k=1))
    banned = plain[0].generated[0]  # the first token prompt 0 would take: biased out below
    params = SamplingParams(tokens_to_generate=12, top_k=1, frequency_penalty=1.5, presence_penalty=0.75,
                            logit_bias=((banned, -100.0), (7, 2.5)))
    got = engine.generate(batch, params)
    for g, p in zip(got, batch):
        assert g.tokens == _reference(engine, p, params, 12)
        assert banned not in g.generated
    assert [g.tokens for g in got] != [g.tokens for g in plain]  # the penalties changed the answer
    assert any(len(set(g.generated)) < 12 for g in plain)  # the plain greedy text repeats tokens


def test_negative_penalties_favour_repeats():
    engine = InferenceEngine(build_model("gpt"), vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=None)
    params = SamplingParams(tokens_to_generate=8, top_k=1, frequency_penalty=-2.0, presence_penalty=-2.0)
    batch = prompts(2)
    assert [g.tokens for g in engine.generate(batch, params)] == [_reference(engine, p, params, 8) for p in batch]


@pytest.fixture(scope="module")
def client():
    pytest.importorskip("flask")
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    engine = InferenceEngine(build_model("gpt"), vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return create_app(Runner(engine), tokenizer, chat_template=template).test_client()


def test_the_fields_reach_the_sampler(client):
    request = {"prompt": "5 17 42 8", "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=request).get_json()["choices"][0]["text"]
    first = plain.split()[0]
    biased = client.post("/v1/completions", json={**request, "logit_bias": {first: -100, "3": 100}}).get_json()
    assert biased["choices"][0]["text"] == " 3 3 3 3"
    penalized = client.post("/v1/completions", json={**request, "logit_bias": {"3": 100},
                                                     "frequency_penalty": 2.0, "presence_penalty": 2.0}).get_json()
    assert penalized["choices"][0]["text"] == " 3 3 3 3"  # 100 outweighs 2 * count + 2 for 4 tokens


@pytest.mark.parametrize("body, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be at most 2.0"),
    ({"frequency_penalty": -3}, "frequency_penalty must be at least -2.0"),
    ({"frequency_penalty": "high"}, "frequency_penalty must be a number"),
    ({"logit_bias": {"5": 101}}, "logit_bias[5] must be at most 100.0"),
    ({"logit_bias": {"5": "up"}}, "logit_bias[5] must be a number"),
    ({"logit_bias": {"100": 1}}, "logit_bias: '100' is not a token id in [0, 100)"),
    ({"logit_bias": {"-1": 1}}, "logit_bias: '-1' is not a token id"),
    ({"logit_bias": [[5, 1]]}, "logit_bias must be an object"),
])
def test_bad_penalty_fields_get_one_json_400(client, body, message):
    r = client.post("/v1/completions", json={"prompt": "1 2", **body})
    assert r.status_code == 400 and r.get_json()["error"]["message"].startswith(message)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1"}], **body})
    assert r.status_code == 400 and r.get_json()["error"]["message"].startswith(message)
