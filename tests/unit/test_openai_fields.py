"""The OpenAI-compatible request parsing: OpenAI's optional fields are nullable, so a field sent as
``null`` (what many clients send for "not set") takes its default instead of a 400; a field this
server does not know is still refused, null or not."""

import pytest

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.api_openai import parse_chat, parse_completion
from megatron_lite.inference.fields import RequestError

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}"
NULLABLE = ["model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "best_of", "stream", "user",
            "presence_penalty", "frequency_penalty", "logit_bias"]


@pytest.fixture
def tokenizer():
    return build_tokenizer("NullTokenizer", vocab_size=99)


def test_null_completion_fields_take_their_defaults(tokenizer):
    plain = parse_completion({"prompt": "1 2 3"}, tokenizer)
    nulls = parse_completion({"prompt": "1 2 3", "logprobs": None, "echo": None, "suffix": None,
                              **dict.fromkeys(NULLABLE)}, tokenizer)
    assert nulls == plain and nulls.params.tokens_to_generate == 16 and nulls.logprobs is None


def test_null_chat_fields_take_their_defaults(tokenizer):
    messages = [{"role": "user", "content": "1 2"}]
    plain = parse_chat({"messages": messages, "max_tokens": 5}, tokenizer, TEMPLATE)
    nulls = parse_chat({"messages": messages, "max_tokens": 5, "max_completion_tokens": None, "logprobs": None,
                        "top_logprobs": None, "tools": None, "response_format": None,
                        **{k: None for k in NULLABLE if k != "max_tokens"}}, tokenizer, TEMPLATE)
    assert nulls == plain and nulls.params.tokens_to_generate == 5
    default = parse_chat({"messages": messages, "max_tokens": None, "max_completion_tokens": None}, tokenizer,
                         TEMPLATE)
    assert default.params.tokens_to_generate == 256


@pytest.mark.parametrize("body, message", [
    ({"prompt": None}, "prompt"),
    ({"prompt": "1", "max_token": None}, "unknown field 'max_token'"),
    ({"prompt": "1", "suffix": "2"}, "suffix (insertion) is not supported"),
    ({"prompt": "1", "n": 3, "best_of": 2}, "best_of must be at least n (3), got 2"),
    ({"prompt": "1", "n": 2, "best_of": 3, "stream": True}, "best_of > n cannot be streamed"),
])
def test_what_stays_refused(tokenizer, body, message):
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_completion(body, tokenizer)


def test_top_p_zero_is_greedy(tokenizer):
    """OpenAI's top_p 0 keeps the most likely token only (the limit of a shrinking nucleus, as
    temperature 0); it became the engine's top_p 0, 'no filtering', and sampled the whole vocabulary."""
    params = parse_completion({"prompt": "1 2", "top_p": 0}, tokenizer).params
    assert params.top_k == 1 and params.top_p == 0.0
    assert parse_completion({"prompt": "1 2", "top_p": 0.5}, tokenizer).params.top_p == 0.5


def test_chat_default_max_tokens_fits_the_context(tokenizer):
    messages = [{"role": "user", "content": "1 2 3"}]
    prompt = parse_chat({"messages": messages}, tokenizer, TEMPLATE).prompts[0]  # "1 2 3 7": 4 tokens
    assert parse_chat({"messages": messages}, tokenizer, TEMPLATE, max_length=96).params.tokens_to_generate == 92
    assert parse_chat({"messages": messages}, tokenizer, TEMPLATE, max_length=4096).params.tokens_to_generate == 256
    assert len(prompt) == 4
    asked = parse_chat({"messages": messages, "max_tokens": 92}, tokenizer, TEMPLATE, max_length=96)
    assert asked.params.tokens_to_generate == 92  # what the client asks for stays; beyond the context it is a 400:
    with pytest.raises(RequestError, match="messages have 4 tokens .* \\+ max_tokens 93, more than the model's"):
        parse_chat({"messages": messages, "max_tokens": 93}, tokenizer, TEMPLATE, max_length=96)


def test_only_streamed_logprobs_ask_the_engine_for_each_steps(tokenizer):
    """The per-step broadcast costs a collective per step: only ``logprobs`` with ``stream`` asks for it."""
    asks = lambda **kw: parse_completion({"prompt": "1 2", **kw}, tokenizer).params.step_log_probs  # noqa: E731
    assert asks(stream=True, logprobs=0) and asks(stream=True, logprobs=3)
    assert not asks(stream=True) and not asks(logprobs=3) and not asks()
    chat = parse_chat({"messages": [{"role": "user", "content": "1"}], "stream": True, "logprobs": True}, tokenizer,
                      TEMPLATE)
    assert chat.params.step_log_probs and chat.logprobs == 0
    best = parse_completion({"prompt": ["1", "2 3"], "n": 2, "best_of": 3}, tokenizer)
    assert (best.n, best.best_of, best.prompts) == (2, 3, [[1]] * 3 + [[2, 3]] * 3)


def test_the_documented_defaults_of_a_bare_completion(tokenizer):
    """docs/inference.md's table: max_tokens 16, temperature 1.0, top_p 1.0 (no filtering), top_k 0, n 1,
    best_of n, no penalties, echo false, logprobs null, stream false."""
    job = parse_completion({"prompt": "1 2 3"}, tokenizer)
    p = job.params
    assert (p.tokens_to_generate, p.temperature, p.top_k, p.top_p) == (16, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.0, 0.0, ())
    assert (job.n, job.best_of, job.echo, job.logprobs, job.stream, job.stops) == (1, 1, False, None, False, [])
    assert parse_completion({"prompt": "1 2 3", "n": 3}, tokenizer).best_of == 3  # best_of defaults to n


@pytest.mark.parametrize("route, body, message", [
    ("completions", {"prompt": "1", "stop": ["a", "b", "c", "d", "e"]}, "stop must be a non-empty string or a list of up to 4"),
    ("completions", {"prompt": "1", "stop": ["a", "b", "c", "d"]}, None),  # 4 is the limit
    ("completions", {"prompt": "1", "logprobs": 21}, "logprobs must be at most 20"),
    ("completions", {"prompt": "1", "logprobs": 20}, None),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be at most 20"),
    ("chat", {"logprobs": True, "top_logprobs": 20}, None),
])
def test_the_documented_limits_of_stop_and_logprobs(tokenizer, route, body, message):
    """docs/inference.md: `stop` is a string or up to 4; `logprobs` (completions) and `top_logprobs` (chat) in [0, 20]."""
    def parse():
        if route == "chat":
            return parse_chat({"messages": [{"role": "user", "content": "1"}], **body}, tokenizer, TEMPLATE)
        return parse_completion(body, tokenizer)

    if message is None:
        parse()
        return
    with pytest.raises(RequestError) as err:
        parse()
    assert str(err.value).startswith(message), err.value


@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "length_penalty"])
def test_nan_is_a_bad_request_naming_the_field(tokenizer, name):
    """OpenAI's temperature takes 0: a NaN one was refused as outside "(0, 100]" by the engine."""
    with pytest.raises(RequestError, match=rf"^{name} must be a finite number, got nan$"):
        parse_completion({"prompt": "1 2", name: float("nan")}, tokenizer)
    with pytest.raises(RequestError, match=r"^logit_bias\[3\] must be a finite number, got nan$"):
        parse_completion({"prompt": "1 2", "logit_bias": {"3": float("nan")}}, tokenizer)


@pytest.mark.parametrize("name", ["model", "user"])
@pytest.mark.parametrize("value", [5, ["x"], {"id": "x"}, True])
def test_model_and_user_that_are_not_strings_are_a_bad_request(tokenizer, name, value):
    """Accepted and not used, they were accepted whatever their type (vLLM's schema refuses it: 400)."""
    with pytest.raises(RequestError, match=rf"^{name} must be a string, got "):
        parse_completion({"prompt": "1 2", name: value}, tokenizer)
    with pytest.raises(RequestError, match=rf"^{name} must be a string, got "):
        parse_chat({"messages": [{"role": "user", "content": "1"}], name: value}, tokenizer, TEMPLATE)
    assert parse_completion({"prompt": "1 2", name: "x"}, tokenizer).params.tokens_to_generate == 16


@pytest.mark.parametrize("body, message", [
    ({"prompt": "hello"}, "prompt: NullTokenizer expects space-separated integers, got 'hello'"),
    ({"prompt": ["1 2", "hi"]}, "prompt[1]: NullTokenizer expects space-separated integers, got 'hi'"),
    ({"prompt": "1 99"}, "prompt: NullTokenizer: a token id is outside [0, 99) (--vocab-size 99), got '1 99'"),
])
def test_a_prompt_the_tokenizer_cannot_read_names_the_prompt(tokenizer, body, message):
    """NullTokenizer's ValueError reached the client as it was: which field, which prompt, was not said."""
    with pytest.raises(RequestError) as err:
        parse_completion(body, tokenizer)
    assert str(err.value) == message


@pytest.mark.parametrize("messages, message", [
    (["hi"], 'messages[0] must be an object {"role": "system" | "user" | "assistant", "content": <string or list '
             "of text parts>}, got 'hi'"),
    ([{"role": "user", "content": "1"}, 7], 'messages[1] must be an object {"role": "system" | "user" | '
                                            '"assistant", "content": <string or list of text parts>}, got 7'),
    ([{"role": "user", "content": "hi"}], "messages: the prompt the chat template renders cannot be tokenized: "
                                          "NullTokenizer expects space-separated integers"),
])
def test_a_chat_message_that_cannot_be_read_names_it(tokenizer, messages, message):
    """A message that is not an object said 'message 0 is not {"role": ..., "content": <string>}'
    (neither the field nor what came); text NullTokenizer cannot read did not name messages."""
    with pytest.raises(RequestError) as err:
        parse_chat({"messages": messages}, tokenizer, TEMPLATE)
    assert str(err.value) == message


@pytest.mark.parametrize("message, field", [
    ({"role": "user", "content": "1 2", "name": "bob"}, "name"),
    ({"role": "user", "content": "1 2", "tool_call_id": "call_1"}, "tool_call_id"),
    ({"role": "assistant", "content": "3", "tool_calls": [{"id": "call_1"}]}, "tool_calls"),
    ({"role": "assistant", "content": "3", "function_call": {"name": "f"}}, "function_call"),
])
def test_a_message_field_other_than_role_and_content_is_refused(tokenizer, message, field):
    """OpenAI's message fields beyond role and content (a participant's name, tool calls) reached the
    chat template, which reads role and content only: "name": "bob" and "name": "alice" got the same
    prompt, silently. Refused naming the message and field; null is taken as absent."""
    chat = [{"role": "user", "content": "1"}, message] if message["role"] == "assistant" else [message]
    chat += [{"role": "user", "content": "4"}] if message["role"] == "assistant" else []
    where = f"messages[{1 if message['role'] == 'assistant' else 0}].{field}"
    with pytest.raises(RequestError) as err:
        parse_chat({"messages": chat}, tokenizer, TEMPLATE)
    assert str(err.value).startswith(f"{where} is not supported")
    nulled = [{**m, field: None} if field in m else m for m in chat]
    plain = [{k: v for k, v in m.items() if k in ("role", "content")} for m in chat]
    assert parse_chat({"messages": nulled}, tokenizer, TEMPLATE) == parse_chat({"messages": plain}, tokenizer, TEMPLATE)


def test_a_request_past_the_context_names_its_own_prompt_and_limit(tokenizer):
    """The length check ran in the engine over the prompts as copied for ``n`` / ``best_of``: with two
    prompts and n=2 the second was "prompt 2", a chat's conversation "prompt 0" (a chat request has no
    prompt). It now names the request's field (``prompt[1]``, ``prompt``, ``messages``) and its limit."""
    ten = " ".join(["1"] * 10)
    cases = [(parse_completion, {"prompt": ["1", ten], "n": 2, "max_tokens": 90}, "prompt[1] has 10 tokens + max_tokens 90"),
             (parse_completion, {"prompt": ten, "best_of": 3, "max_tokens": 87}, "prompt has 10 tokens + max_tokens 87"),
             (parse_completion, {"prompt": [1] * 97, "max_tokens": 0, "echo": True}, "prompt has 97 tokens"),
             (parse_completion, {"prompt": [[1], [1] * 96], "max_tokens": 1}, "prompt[1] has 96 tokens + max_tokens 1"),
             (parse_chat, {"messages": [{"role": "user", "content": ten}], "max_completion_tokens": 90},
              "messages have 11 tokens (through the chat template) + max_completion_tokens 90")]
    for parse, body, start in cases:
        args = (TEMPLATE,) if parse is parse_chat else ()
        with pytest.raises(RequestError) as err:
            parse(body, tokenizer, *args, max_length=96)
        assert str(err.value).startswith(start + ", more than the model's context of 96 tokens"), str(err.value)
    assert parse_completion({"prompt": ten, "n": 2, "max_tokens": 86}, tokenizer, max_length=96).params.tokens_to_generate == 86


def test_the_server_answers_a_request_past_the_context_naming_its_field():
    from tests.inference_helpers import served_gpt

    client = served_gpt()[0]
    answer = client.post("/v1/completions", json={"prompt": ["1", " ".join(["2"] * 10)], "n": 2, "max_tokens": 90})
    assert answer.status_code == 400
    assert answer.get_json()["error"]["param"] == "prompt[1]"
    answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1"}], "max_tokens": 95})
    assert answer.status_code == 400 and answer.get_json()["error"]["param"] == "messages"


def test_chat_max_tokens_and_max_completion_tokens_that_differ_are_refused(tokenizer):
    """With both, max_completion_tokens won and max_tokens was silently ignored; equal values (what a
    client filling both sends) are one limit."""
    messages = [{"role": "user", "content": "1 2"}]
    with pytest.raises(RequestError, match="max_tokens 5 and max_completion_tokens 2 differ; send one of them"):
        parse_chat({"messages": messages, "max_tokens": 5, "max_completion_tokens": 2}, tokenizer, TEMPLATE)
    both = parse_chat({"messages": messages, "max_tokens": 3, "max_completion_tokens": 3}, tokenizer, TEMPLATE)
    assert both.params.tokens_to_generate == 3
