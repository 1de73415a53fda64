"""Chat prompts for ``/v1/chat/completions``: messages -> the token ids the model continues.

The conversion is SFT's (:func:`~megatron_lite.data.chat_template.chat_tokens` with
``add_generation_prompt=True``), so a model fine-tuned here is prompted exactly as it was trained:
the chat template of a Hugging Face tokenizer's folder (``chat_template.jinja`` or
``tokenizer_config.json``), else the documented default (``User: ...`` / ``Assistant: ``). A
server's ``--chat-template FILE`` replaces either. Jinja2 comes with Flask (the ``serve`` extra).
A message's content is a string or OpenAI's list of text parts (other part types are a 400); a
message holds only role and content (``name``, ``tool_calls``, ... are a 400).
"""

from __future__ import annotations

import os

from ..data.chat_template import ConversationError, chat_tokens, compile_template
from ..errors import ConfigError
from .fields import RequestError


def read_chat_template(path: str | None) -> str | None:
    """The text of ``--chat-template FILE`` (None: none given), checked to parse."""
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ConfigError(f"--chat-template {path} does not exist")
    with open(path, encoding="utf-8") as f:
        template = f.read()
    try:
        compile_template(template)
    except ConversationError as err:
        raise ConfigError(f"--chat-template {path}: {err}") from None
    return template


MESSAGE_FIELDS = ("role", "content")
"""What a message may hold: the chat template reads these only."""


def _message_fields(messages) -> list:
    """``messages`` with their null fields dropped (null: absent, as for the request's fields); a
    message field other than role and content (OpenAI's ``name``, ``tool_calls``, ``tool_call_id``,
    ...) is a :class:`RequestError` naming it: the template would not read it, so it is never
    silently ignored."""
    if not isinstance(messages, list):
        return messages
    kept = []
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            m = {k: v for k, v in m.items() if v is not None or k in MESSAGE_FIELDS}
            for key in m:
                if key not in MESSAGE_FIELDS:
                    raise RequestError(f"messages[{i}].{key} is not supported (a message holds only role and "
                                       f"content: the chat template reads nothing else); drop it")
        kept.append(m)
    return kept


def chat_prompt(tokenizer, messages, template: str | None = None) -> list[int]:
    """The prompt ids for the assistant's next turn after ``messages``; a conversation the template
    cannot take is a :class:`RequestError` (HTTP 400) naming the problem."""
    messages = _message_fields(messages)
    try:
        from jinja2 import TemplateError  # a template failing on these messages
    except ImportError:  # only the default template renders without Jinja2
        TemplateError = ConversationError
    try:
        ids = chat_tokens(tokenizer, messages, add_generation_prompt=True, template=template).ids
    except ConversationError as err:
        raise RequestError(str(err)) from None
    except TemplateError as err:
        raise RequestError(f"the chat template failed on these messages: {err}") from None
    except ValueError as err:  # the tokenizer's: NullTokenizer reads only space-separated token ids
        raise RequestError(f"messages: the prompt the chat template renders cannot be tokenized: {err}") from None
    if not ids:
        raise RequestError("the chat template rendered the messages as an empty prompt")
    return ids
