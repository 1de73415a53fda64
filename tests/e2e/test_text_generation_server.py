"""tools/run_text_generation_server.py answering a real HTTP client (httpx).

One process: the server runs in a thread on a free localhost port over a saved checkpoint
(NullTokenizer: text is space-separated token ids; the ``server`` and ``checkpoint`` fixtures are in
tests/e2e/conftest.py). Both APIs answer what the engine computes
(tokens equal, log-probs within 1e-5 relative to the largest), batched prompts, log-probs and
seeded samples included; every bad request gets HTTP 400 with one line naming the field, and the
server keeps serving; beam search answers Megatron's text, segments and scores. The same server
under torchrun at TP2: tests/e2e/test_text_generation_server_tp2.py.
"""

import pytest
import torch

from megatron_lite.inference.sampling import SamplingParams
from tests.e2e.conftest import PROMPTS
from tests.inference_helpers import MAX_LEN, assert_close
from tests.tools import load_tool

httpx = pytest.importorskip("httpx")
pytest.importorskip("flask")


def ids(text):
    return [int(t) for t in text.split()]


def test_api_answers_a_batch_with_log_probs_like_the_engine(server):
    url, engine, _ = server
    r = httpx.put(f"{url}/api", json={"prompts": PROMPTS, "tokens_to_generate": 6, "logprobs": True, "top_k": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    want = engine.generate([ids(p) for p in PROMPTS], SamplingParams(tokens_to_generate=6, top_k=1))
    assert body["tokens"] == [g.tokens for g in want]
    for text, got_lp, segments, g, prompt in zip(body["text"], body["logprobs"], body["segments"], want, PROMPTS):
        assert_close(torch.tensor(got_lp), torch.tensor(g.log_probs))
        # each token's segment is the text it adds: NullTokenizer puts a space before every token but the first
        assert len(got_lp) == len(g.tokens) - 1 and segments == [("" if i == 0 else " ") + str(t)
                                                                  for i, t in enumerate(g.tokens)]
        assert text == prompt + "".join(f" {t}" for t in g.generated)


def test_a_seeded_sample_is_reproducible(server):
    url = server[0]
    ask = lambda seed: httpx.put(f"{url}/api", json={"prompts": PROMPTS, "tokens_to_generate": 12,  # noqa: E731
                                                     "top_p": 0.9, "temperature": 1.3, "random_seed": seed}).json()
    first, again, other = ask(3), ask(3), ask(4)
    assert first == again
    assert first["tokens"] != other["tokens"]


@pytest.mark.parametrize("body, message", [
    ({"tokens_to_generate": 4}, "prompts argument required"),
    ({"prompts": ["1 2"], "tokens_to_generate": -1}, "tokens_to_generate must be at least 0"),
    ({"prompts": ["1 2"], "top_k": 5, "top_p": 0.5}, "cannot set both top_k and top_p"),
    ({"prompts": [" ".join(["1"] * 95)], "tokens_to_generate": 4},
     "prompt 0 has 95 tokens + 4 tokens to generate, more than the model's 96"),
    ({"prompts": "1 2"}, "prompts must be a list of strings"),
    ({"prompts": ["1"], "max_len": 4}, "max_len is no longer used; replace it with tokens_to_generate"),
    ({"prompts": ["1", "2"], "beam_width": 2}, "beam_width: beam search takes exactly one prompt, got 2"),
    ({"prompts": ["1"], "beam_width": 2, "temperature": 0.5}, "temperature does not apply to beam search"),
    ({"prompts": ["1"], "beam_width": 2, "logprobs": True}, "logprobs does not apply to beam search"),
    ({"prompts": ["1"], "beam_width": 0}, "beam_width must be at least 1"),
    ({"prompts": ["1"], "beam_width": 129}, "beam_width must be at most 99"),
    ({"prompts": ["1"], "length_penalty": 2.0}, "length_penalty applies to beam search only"),
    ({"prompts": ["1"], "stop_token": 100}, "stop_token must be at most 99"),
    ({"prompts": ["1"], "top_p_decay": 0.5}, "top_p_decay needs top_p > 0"),
    ({"prompts": ["1"], "top_p": 0.5, "top_p_bound": 0.6}, "top_p_bound must be at most 0.5"),
    ({"prompts": ["1"], "top_p": 0.5, "top_p_bound": 0.0}, "top_p_bound must be greater than 0.0"),
    ({"prompts": ["1"], "top_p": 0.5, "top_p_decay": 1.5}, "top_p_decay must be at most 1.0"),
    ({"prompts": ["1"], "stop_on_double_eol": 1}, "stop_on_double_eol must be a boolean"),
    ({"prompts": ["1"], "temperature": 0}, "temperature must be greater than 0"),
    ({"prompts": ["1"], "tokens_to_generate": 0}, "tokens_to_generate=0 only scores the prompts: it needs logprobs"),
    ({"prompts": [""]}, "an empty prompt needs add_BOS=true"),
    ({"prompts": ["1"], "colour": 1}, "unknown field 'colour'"),
])
def test_bad_api_requests_get_400_with_one_line_and_the_server_keeps_serving(server, body, message):
    url = server[0]
    r = httpx.put(f"{url}/api", json=body)
    assert r.status_code == 400
    assert r.json()["message"].startswith(message) and "\n" not in r.json()["message"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.put(f"{url}/api", json={"prompts": ["1 2"], "tokens_to_generate": 1}).status_code == 200


def test_a_tiny_temperature_is_greedy_on_both_apis(server):
    url, engine, _ = server
    greedy = engine.generate([ids(PROMPTS[0])], SamplingParams(tokens_to_generate=6, top_k=1))[0].generated
    r = httpx.put(f"{url}/api", json={"prompts": [PROMPTS[0]], "tokens_to_generate": 6, "temperature": 1e-38})
    assert r.status_code == 200 and r.json()["tokens"][0][4:] == greedy
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ids(PROMPTS[0]), "max_tokens": 6, "temperature": 1e-38,
                                                  "stop": None})
    assert r.status_code == 200 and ids(r.json()["choices"][0]["text"]) == greedy


def test_an_error_while_generating_is_a_json_500_and_the_server_keeps_serving(server, monkeypatch):
    url, engine, _ = server
    healthy = engine.forward
    monkeypatch.setattr(engine, "forward", lambda *a, **k: healthy(*a, **k).fill_(float("nan")))
    for method, path, body in [("put", "/api", {"prompts": ["1 2"], "tokens_to_generate": 2}),
                               ("post", "/v1/completions", {"prompt": "1 2", "max_tokens": 2}),
                               ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}]})]:
        r = getattr(httpx, method)(f"{url}{path}", json=body)
        assert r.status_code == 500 and r.headers["content-type"] == "application/json", path
        got = r.json()["error"] if path.startswith("/v1/") else r.json()
        assert got["message"].startswith("NonFiniteLogitsError: the model's logits hold NaN or inf"), path
    monkeypatch.setattr(engine, "forward", healthy)
    assert httpx.put(f"{url}/api", json={"prompts": ["1 2"], "tokens_to_generate": 1}).status_code == 200


def test_add_bos_prepends_the_end_of_document_token_without_a_bos(server):
    body = httpx.put(f"{server[0]}/api", json={"prompts": ["", "5 17"], "add_BOS": True, "tokens_to_generate": 2,
                                               "top_k": 1}).json()
    assert [t[:len(p)] for t, p in zip(body["tokens"], ([99], [99, 5, 17]))] == [[99], [99, 5, 17]]


def test_add_bos_prepends_the_tokenizers_bos_when_it_has_one():
    from types import SimpleNamespace

    from megatron_lite.inference.api_megatron import parse_api

    tok = SimpleNamespace(bos=1, eod=2, vocab_size=10, tokenize=lambda t: [int(x) for x in t.split()])
    assert parse_api({"prompts": ["", "5 7"], "add_BOS": True}, tok).prompts == [[1], [1, 5, 7]]
    assert parse_api({"prompts": ["5 7"]}, tok).prompts == [[5, 7]]


def test_stop_on_eol_stops_at_tokens_holding_a_newline():
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.api_megatron import newline_token_ids, parse_api
    from tests.inference_helpers import GPT2_TOKENIZER

    tok = build_tokenizer(**GPT2_TOKENIZER)
    ids = newline_token_ids(tok)
    assert {tok.tokenize("\n")[0], tok.tokenize("\n\n")[0], tok.tokenize(".\n")[-1]} <= set(ids)
    assert tok.tokenize("a")[0] not in ids and tok.tokenize(" the")[0] not in ids
    job = parse_api({"prompts": ["Hi"], "stop_on_eol": True}, tok)
    assert set(job.params.stop_token_ids) == set(ids)


def test_beam_search_answers_megatrons_beam_shape(server):
    url, engine, tokenizer = server
    want = engine.generate([ids(PROMPTS[1])], SamplingParams(tokens_to_generate=6, beam_width=3, length_penalty=0.5))
    r = httpx.put(f"{url}/api", json={"prompts": [PROMPTS[1]], "tokens_to_generate": 6, "beam_width": 3,
                                      "length_penalty": 0.5, "temperature": 1.0})  # a default sampling value passes
    body = r.json()
    assert r.status_code == 200 and set(body) == {"text", "segments", "scores"}
    assert [ids(t) for t in body["text"]] == [w.tokens for w in want] and len(body["text"]) == 3
    assert ["".join(s) for s in body["segments"]] == body["text"]  # the segments join to each hypothesis' text
    assert [len(s) for s in body["segments"]] == [len(w.tokens) for w in want]
    assert body["scores"] == pytest.approx([w.score for w in want]) and body["scores"] == sorted(body["scores"])[::-1]


def test_stop_token_ends_a_sample_instead_of_the_end_of_document(server):
    url, engine, _ = server
    greedy = engine.generate([ids(PROMPTS[0])], SamplingParams(tokens_to_generate=10, top_k=1, stop_on_eod=False))
    stop = greedy[0].generated[3]
    first = greedy[0].generated.index(stop)
    r = httpx.put(f"{url}/api", json={"prompts": [PROMPTS[0]], "tokens_to_generate": 10, "top_k": 1,
                                      "stop_token": stop}).json()
    assert r["tokens"][0][4:] == greedy[0].generated[:first + 1]


def test_megatron_text_fields_map_to_the_tokenizers_newline_and_colon_tokens():
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.api_megatron import parse_api, special_token_ids
    from tests.inference_helpers import GPT2_TOKENIZER

    tok = build_tokenizer(**GPT2_TOKENIZER)
    newline, two, colon = special_token_ids(tok)
    assert {198, 628} <= set(newline) and 628 in two and 198 not in two  # GPT-2's "\n" and "\n\n"
    assert tok.tokenize(":")[0] in colon and tok.tokenize("):")[-1] in colon and tok.tokenize(" the")[0] not in colon
    p = parse_api({"prompts": ["Hi"], "stop_on_double_eol": True, "stop_on_eol": True}, tok).params
    assert p.stop_token_ids == two and p.double_stop_ids == newline and p.stop_on_eod  # double wins over single
    p = parse_api({"prompts": ["Hi"], "prevent_newline_after_colon": True, "stop_token": 13}, tok).params
    assert (p.ban_after_ids, p.banned_ids, p.stop_token_ids, p.stop_on_eod) == (colon, newline, (13,), False)
    p = parse_api({"prompts": ["Hi"], "top_p": 0.8, "top_p_decay": 0.9, "top_p_bound": 0.2}, tok).params
    assert (p.top_p, p.top_p_decay, p.top_p_bound) == (0.8, 0.9, 0.2)


def test_a_non_json_body_gets_400(server):
    r = httpx.put(f"{server[0]}/api", content=b"prompts=1", headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and r.json() == {"message": "the request body must be JSON"}


def test_completions_with_echo_logprobs_and_a_stop_string(server):
    url, engine, _ = server
    request = {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}
    body = httpx.post(f"{url}/v1/completions", json=request).json()
    want = engine.generate([ids(p) for p in PROMPTS], SamplingParams(tokens_to_generate=6, top_k=1,
                                                                      top_n_logprobs=2))
    assert body["object"] == "text_completion" and len(body["choices"]) == 2
    assert body["usage"]["completion_tokens"] == sum(len(g.generated) for g in want)
    for choice, g in zip(body["choices"], want):
        lp = choice["logprobs"]
        # each token as its text in the answer: NullTokenizer puts a space before every id but the first
        assert lp["tokens"] == [str(g.tokens[0])] + [f" {t}" for t in g.tokens[1:]] and lp["token_logprobs"][0] is None
        assert_close(torch.tensor(lp["token_logprobs"][1:]), torch.tensor(g.log_probs))
        for position, top in enumerate(lp["top_logprobs"][g.prompt_length:], start=g.prompt_length):
            best = max(top, key=top.get)  # greedy: the generated token is the most likely one
            assert len(top) == 2 and best == f" {g.tokens[position]}"
        assert choice["text"] == "".join(lp["tokens"])  # NullTokenizer: ids joined by spaces
    # token-id prompt, no echo, a stop string: the text ends before it
    g = want[0]
    stop = str(g.generated[2])
    body = httpx.post(f"{url}/v1/completions", json={"prompt": g.tokens[:g.prompt_length], "max_tokens": 6,
                                                     "temperature": 0, "stop": [stop]}).json()
    text = "".join(f" {t}" for t in g.generated)
    assert body["choices"][0]["text"] == text[:text.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    # usage counts the tokens returned: those whose text lies before the stop string, not the 6 generated
    returned = next(k for k in range(7) if len("".join(f" {t}" for t in g.generated[:k])) >= text.find(stop))
    assert returned < 6 and body["usage"]["completion_tokens"] == returned
    assert body["usage"]["total_tokens"] == g.prompt_length + returned


def test_chat_completions_render_the_template(server):
    url, engine, _ = server
    messages = [{"role": "user", "content": "5 17"}, {"role": "assistant", "content": "42"},
                {"role": "user", "content": "8"}]
    body = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 5,
                                                          "temperature": 0}).json()
    want = engine.generate([[5, 17, 42, 8, 7]], SamplingParams(tokens_to_generate=5, top_k=1))[0]
    assert body["object"] == "chat.completion"
    content = "".join(f" {t}" for t in want.generated)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": content}
    # OpenAI's content parts (what the official clients send): the texts joined with newlines
    parts = [{"role": "user", "content": [{"type": "text", "text": "5"}, {"type": "text", "text": "17"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "42"}]}, messages[2]]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": parts, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == {"role": "assistant", "content": content}


def test_chat_without_max_tokens_fills_what_the_context_leaves(server):
    url, engine, _ = server  # a 96-token context: the default 256 new tokens do not fit after the prompt
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "5 17"}],
                                                       "temperature": 0, "max_tokens": None})
    assert r.status_code == 200, r.text
    want = engine.generate([[5, 17, 7]], SamplingParams(tokens_to_generate=MAX_LEN - 3, top_k=1))[0]
    assert r.json()["choices"][0]["message"]["content"] == "".join(f" {t}" for t in want.generated)
    assert r.json()["usage"]["completion_tokens"] == len(want.generated)


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"max_tokens": 3}, "prompt is required"),
    ("/v1/completions", {"prompt": "1", "n": 2, "best_of": 1}, "best_of must be at least n (2), got 1"),
    ("/v1/completions", {"prompt": "1", "top_k": 3, "top_p": 0.5}, "cannot set both top_k and top_p"),
    ("/v1/completions", {"prompt": "1", "max_tokens": -2}, "max_tokens must be at least 0"),
    ("/v1/completions", {"prompt": "1", "presence_penalty": 2.5}, "presence_penalty must be at most 2.0"),
    ("/v1/completions", {"prompt": [[1, 200]]}, "a prompt token id is outside the vocabulary [0, 100)"),
    ("/v1/chat/completions", {"messages": "hi"}, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]},
     "a generation prompt must end with a user turn"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "1"}]}, "messages[0] has unknown role 'robot'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0] has type 'image_url': only text parts are supported"),
])
def test_bad_openai_requests_get_400(server, path, body, message):
    r = httpx.post(f"{server[0]}{path}", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(message)


def test_chat_prompts_are_the_sft_generation_prompts(tmp_path):
    """The tokenizer's own template, else SFT's default, else --chat-template: as the model was trained."""
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.errors import ConfigError
    from megatron_lite.inference.chat import chat_prompt, read_chat_template
    from tests.sft_helpers import CHATML, write_tokenizer

    pytest.importorskip("tokenizers")
    messages = [{"role": "system", "content": "red"}, {"role": "user", "content": "two cat"}]
    chatml = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(tmp_path / "chatml", CHATML))
    plain = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(tmp_path / "plain"))
    encode = lambda tok, text: tok.hf.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert chat_prompt(chatml, messages) == encode(chatml, "<|im_start|>system\nred<|im_end|>\n<|im_start|>user\n"
                                                            "two cat<|im_end|>\n<|im_start|>assistant\n")
    assert chat_prompt(plain, messages) == encode(plain, "System: red\n\nUser: two cat\n\nAssistant: ")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}{{ eos_token }}")
    assert chat_prompt(chatml, messages, read_chat_template(str(template))) == encode(chatml, "red two cat <|endoftext|>")
    with pytest.raises(ConfigError, match="^--chat-template .*missing.jinja does not exist$"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    template.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="^--chat-template .*t.jinja: the chat template does not parse: "):
        read_chat_template(str(template))


def test_text_generation_cli_talks_to_the_server(server, capsys):
    host = server[0][len("http://"):]
    answers = iter(["5 17", "3", "5 17", "-1"])

    def read(_prompt):
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    assert load_tool("text_generation_cli").main([host], read=read) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Megatron Response: 5 17") and len(out[0].split()) == 2 + 2 + 3
    assert out[1] == "Error 400: tokens_to_generate must be at least 0, got -1"
