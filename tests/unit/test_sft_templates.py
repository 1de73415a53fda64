"""Chat templates of Hugging Face tokenizers in SFT data: generation blocks, a template failing on one
conversation, the tools/documents arguments, special tokens from special_tokens_map.json."""

import json
import os

import pytest

from megatron_lite.data.builder import DataConfigError
from megatron_lite.data.chat_template import chat_tokens
from megatron_lite.data.sft_conversations import read_conversations
from megatron_lite.data.tokenizers import build_tokenizer
from tests.sft_helpers import CHAT, CHATML, VOCAB, hf_tokenizers, write_tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return hf_tokenizers(tmp_path_factory.mktemp("tok"))


def test_hf_generation_blocks_render_as_their_body(tmp_path, tokenizers):
    """Hugging Face templates may wrap assistant text in {% generation %}...{% endgeneration %} (for its
    assistant masks); such a template was a TemplateSyntaxError traceback. It gives ChatML's tokens and
    learned tokens exactly."""
    tagged = CHATML.replace("{{ message['content'] }}<|im_end|>",
                            "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}")
    assert "generation" in tagged
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(tmp_path / "tagged", tagged))
    want, got = chat_tokens(tokenizers["chatml"], CHAT), chat_tokens(tok, CHAT)
    assert (got.ids, got.trained) == (want.ids, want.trained)
    prompt = chat_tokens(tok, CHAT[:2], add_generation_prompt=True)
    assert prompt.ids == chat_tokens(tokenizers["chatml"], CHAT[:2], add_generation_prompt=True).ids


def test_template_failing_on_a_conversation_is_a_bad_line(tmp_path):
    """A template error while rendering one conversation (here an undefined attribute) names file:line
    and is skippable, instead of a jinja2 traceback."""
    template = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'system' %}{{ m.x.y }}{% endif %}{% endfor %}"
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(tmp_path / "tok", template))
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": "why", "response": "sun"}) + "\n"
                    + json.dumps({"system": "red", "prompt": "why", "response": "sun"}) + "\n")
    with pytest.raises(DataConfigError, match=r"c\.jsonl:2: the chat template failed on this conversation"):
        read_conversations(str(path), tok)
    kept = read_conversations(str(path), tok, skip_bad=True)
    assert len(kept) == 1 and kept.skipped["chat template"] == 1
    # a Python error inside the template (str - int) is the same: it was a TypeError traceback
    template = template.replace("{{ m.x.y }}", "{{ m['content'] - 1 }}")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(tmp_path / "tok2", template))
    with pytest.raises(DataConfigError, match=r"c\.jsonl:2: the chat template failed on this conversation: TypeError"):
        read_conversations(str(path), tok)
    assert read_conversations(str(path), tok, skip_bad=True).skipped["chat template"] == 1


def test_template_sees_tools_and_documents_as_none_as_hugging_face_passes_them(tmp_path, tokenizers):
    """Hugging Face renders a chat template with ``tools=None, documents=None`` (and ``strftime_now``);
    here they were undefined, so a template's ``{% if tools is not none %}`` branch ran: its tools block
    was rendered (or ``tools | tojson`` raised a TypeError traceback). The ids now equal
    ``apply_chat_template``'s, for training and for the generation prompt."""
    transformers = pytest.importorskip("transformers")
    template = ("{% if tools is not none %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
                "{% if documents is not none %}{{ documents | tojson }}{% endif %}"
                "{% if strftime_now is defined %}{{ strftime_now('') }}{% endif %}" + CHATML)
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(tmp_path / "tools", template))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tools"))
    for messages, prompt in ((CHAT, False), (CHAT[:4], True)):
        want = hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        got = chat_tokens(tok, messages, add_generation_prompt=prompt)
        assert got.ids[:len(got.ids) - (not prompt)] == want  # training adds the EOD
    assert chat_tokens(tok, CHAT).trained == chat_tokens(tokenizers["chatml"], CHAT).trained


def test_template_special_tokens_of_special_tokens_map_json(tmp_path):
    """A template writing ``{{ bos_token }}`` whose BOS is named only in special_tokens_map.json (older
    repos): it rendered as "" here, "<|im_start|>" in transformers; the ids now equal apply_chat_template's."""
    transformers = pytest.importorskip("transformers")
    folder = write_tokenizer(tmp_path / "old", "{{ bos_token }}" + CHATML)
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}, f)
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
    want = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(CHAT, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat_tokens(tok, CHAT).ids[:-1] == want and want[0] == VOCAB.index("<|im_start|>")
