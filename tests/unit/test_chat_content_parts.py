"""OpenAI's message content as a list of parts (``[{"type": "text", "text": ...}, ...]``), which the
official clients send: it was a 400 on /v1/chat/completions. Text parts give the prompt of their
texts joined with newlines (the default template, a template reading content as a string), or reach
a template that loops over a message's content as the list itself, as Hugging Face's
``apply_chat_template`` passes it; other part types and malformed parts are a 400 naming the part."""

import os

import pytest

from megatron_lite.data.chat_template import chat_tokens, hf_chat_template, render_prompt
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.api_openai import parse_chat
from megatron_lite.inference.fields import RequestError
from tests.sft_helpers import CHATML, write_tokenizer

# a ChatML that prints each text part followed by " !" (as multimodal models' templates loop over parts)
PARTS = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
         "{{ message['content'] }}{% else %}{% for part in message.content | selectattr('type', 'eq', 'text') %}"
         "{{ part['text'] }} !{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the same, reading the parts through a name set to the content (no string branch: parts only)
SET_PARTS = ("{% for message in messages %}{% set content = message['content'] %}<|im_start|>{{ message['role'] }}\n"
             "{% for part in content | selectattr('type', 'eq', 'text') %}{{ part['text'] }} !{% endfor %}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def text(*texts):
    return [{"type": "text", "text": t} for t in texts]


CHAT = [{"role": "system", "content": text("red")}, {"role": "user", "content": text("two cat", "dog")},
        {"role": "assistant", "content": text("sun", "moon")}, {"role": "user", "content": "why"}]
JOINED = [{"role": "system", "content": "red"}, {"role": "user", "content": "two cat\ndog"},
          {"role": "assistant", "content": "sun\nmoon"}, {"role": "user", "content": "why"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(root / name, template))
            for name, template in (("default", None), ("chatml", CHATML), ("parts", PARTS), ("set_parts", SET_PARTS))}


@pytest.mark.parametrize("name", ["default", "chatml"])
def test_text_parts_give_the_prompt_of_their_texts_joined(tokenizers, name):
    """System, user and assistant turns as parts: the chat prompt, SFT's tokens and learned flags, and
    lm-eval's rendered text (a last message left open included) are those of the joined strings."""
    tok = tokenizers[name]
    assert parse_chat({"messages": CHAT}, tok).prompts == parse_chat({"messages": JOINED}, tok).prompts
    got, want = chat_tokens(tok, CHAT[:3]), chat_tokens(tok, JOINED[:3])
    assert (got.ids, got.trained) == (want.ids, want.trained) and any(got.trained)
    if name == "chatml":
        template = hf_chat_template(tok)
        for open_last in (False, True):
            assert render_prompt(template, CHAT[:3], open_last) == render_prompt(template, JOINED[:3], open_last)


def test_a_template_reading_parts_gets_the_list_as_hugging_face_passes_it(tokenizers):
    """A template looping over ``message.content`` renders the parts themselves (not their joined text):
    the prompt is ``apply_chat_template``'s on the same messages; a string-only template gets the
    joined text (transformers would print the list's Python repr into the prompt)."""
    transformers = pytest.importorskip("transformers")

    def hf(name, messages):
        ids = transformers.AutoTokenizer.from_pretrained(os.path.dirname(tokenizers[name].path)).apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    tok = tokenizers["parts"]
    prompt = parse_chat({"messages": CHAT}, tok).prompts[0]
    assert prompt == hf("parts", CHAT) != parse_chat({"messages": JOINED}, tok).prompts[0]
    assert tok.detokenize(prompt).count("!") == 5  # one per part
    assert parse_chat({"messages": CHAT}, tokenizers["chatml"]).prompts[0] == hf("chatml", JOINED)
    parts_only = CHAT[:3]  # a template that sets a name to the content and loops over it: the parts too
    prompt = parse_chat({"messages": parts_only + [{"role": "user", "content": text("why")}]}, tokenizers["set_parts"])
    assert prompt.prompts[0] == hf("set_parts", parts_only + [{"role": "user", "content": text("why")}])
    assert tokenizers["set_parts"].detokenize(prompt.prompts[0]).count("!") == 6  # it had no text at all (the joined string's letters)


@pytest.mark.parametrize("content, message", [
    ([{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}],
     "messages[1].content[0] has type 'image_url': only text parts are supported"),
    (text("why") + [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
     "messages[1].content[1] has type 'input_audio': only text parts are supported"),
    ([{"type": "text"}], 'messages[1].content[0]: a text part needs "text": <string>'),
    ([{"type": "text", "text": 3}], 'messages[1].content[0]: a text part needs "text": <string>'),
    (["why"], 'messages[1].content[0] must be an object {"type": "text", "text": <string>}, got \'why\''),
    ([{"text": "why"}], 'messages[1].content[0] must be an object {"type": "text", "text": <string>}, got '
                        "{'text': 'why'}"),
    ({"type": "text", "text": "why"}, 'messages[1].content must be a string or a list of text parts '
                                      '({"type": "text", "text": <string>}), got {\'type\': \'text\', \'text\': \'why\'}'),
])
@pytest.mark.parametrize("name", ["default", "parts"])
def test_other_and_malformed_parts_are_refused_naming_the_part(tokenizers, name, content, message):
    messages = [{"role": "system", "content": text("red")}, {"role": "user", "content": content}]
    with pytest.raises(RequestError) as err:
        parse_chat({"messages": messages}, tokenizers[name])
    assert str(err.value) == message or str(err.value).startswith(message + " ("), str(err.value)
