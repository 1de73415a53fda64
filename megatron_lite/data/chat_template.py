"""Chat conversations -> token ids, and which of them a fine-tuned model learns (the assistant's).

``chat_tokens(tokenizer, messages)`` is the one place a conversation ``[{"role": "system" | "user"
| "assistant", "content": str}, ...]`` becomes tokens: SFT training (the ``trained`` flags say
where the loss is) and chat inference (``add_generation_prompt=True``: the prompt the model
continues) both call it, so a model is prompted exactly as it was trained.

A ``content`` may also be OpenAI's list of parts, ``[{"type": "text", "text": str}, ...]``: text
parts only (any other type, an image or audio, is refused naming it). The default template and a
Jinja template that reads ``content`` as a string get the texts joined with newlines; a template
that loops over a message's content (``{% for part in message['content'] %}``, as multimodal
models' templates do) gets the list as given, as Hugging Face's ``apply_chat_template`` passes it
(:func:`content_text`, :func:`reads_parts`).

The template:

* a ``HuggingFaceTokenizer`` whose folder holds a chat template (``chat_template.jinja``, or
  ``"chat_template"`` in ``tokenizer_config.json``) uses it, rendered with Jinja2 in a sandbox as
  Hugging Face does (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ...).
  The trained tokens are found by rendering each prefix of the conversation: assistant turn ``i``
  is the text between ``render(messages[:i], add_generation_prompt=True)`` and
  ``render(messages[:i + 1])`` (its content and the template's end-of-turn marker), and a token is
  trained when it starts inside such a span (offsets from the tokenizer). A template that does not
  render a conversation prefix by prefix is refused;
* every other tokenizer (or a Hugging Face one without a template) uses this simple default, each
  piece tokenized on its own::

      system     "System: {content}\\n\\n"                      not trained
      user       "User: {content}\\n\\n"                        not trained
      assistant  "Assistant: " (not trained) "{content}\\n\\n" (trained)
      generation prompt "Assistant: "

After the last turn comes the tokenizer's end-of-document token (trained: the model learns to
stop), unless the template already ended with it. Conversations are checked first
(:func:`check_messages`): known roles, a system message only first, every assistant turn right
after a user turn and not empty, at least one assistant turn; a problem raises
:class:`ConversationError` with the reason (the data readers add ``file:line``).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from dataclasses import dataclass

from megatron_lite.data.tokenizers import encodable

ROLES = ("system", "user", "assistant")
DEFAULT_HEADERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}
DEFAULT_SEPARATOR = "\n\n"


class ConversationError(ValueError):
    """A conversation the chat template cannot take (unknown role, assistant turn first, ...);
    ``reason`` is a short name for counting skipped conversations."""

    def __init__(self, message: str, reason: str = "malformed message"):
        super().__init__(message)
        self.reason = reason


@dataclass
class ChatTokens:
    ids: list[int]
    trained: list[bool]  # True where the model learns the token (assistant text, end of turn, final EOD)

    def __len__(self) -> int:
        return len(self.ids)


def shown(value, limit: int = 60) -> str:
    """``value`` as an error message quotes it: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_messages(messages, generation: bool = False) -> None:
    """Raise :class:`ConversationError` naming the first problem of ``messages``. ``generation``:
    a prompt for the next assistant turn (it ends with a user turn and needs no assistant turn)."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConversationError(f"messages[{i}] must be an object {{\"role\": \"system\" | \"user\" | \"assistant\", "
                                    f"\"content\": <string or list of text parts>}}, got {shown(m)}")
        text = content_text(m.get("content"), i)
        role = m.get("role")
        if role not in ROLES:
            raise ConversationError(f"messages[{i}] has unknown role {role!r} (expected system, user or assistant)",
                                    "unknown role")
        if role == "system" and i > 0:
            raise ConversationError(f"messages[{i}]: a system message may only come first", "system message not first")
        if role == "assistant":
            if i == 0 or messages[i - 1]["role"] != "user":
                raise ConversationError(f"messages[{i}]: an assistant turn must follow a user turn",
                                        "assistant turn not after a user turn")
            if not text.strip():
                raise ConversationError(f"messages[{i}]: empty assistant turn (nothing to learn)", "empty assistant turn")
    if generation:
        if messages[-1]["role"] != "user":
            raise ConversationError("a generation prompt must end with a user turn")
    elif not any(m["role"] == "assistant" for m in messages):
        raise ConversationError("no assistant turn (nothing to learn)", "no assistant turn")


def content_text(content, index: int) -> str:
    """Message ``index``'s content as text: a string as it is, OpenAI's list of text parts joined with
    newlines (as vLLM joins them); anything else is a :class:`ConversationError` naming the part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConversationError(f"messages[{index}].content must be a string or a list of text parts "
                                f"({{\"type\": \"text\", \"text\": <string>}}), got {shown(content)}")
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise ConversationError(f"{where} must be an object {{\"type\": \"text\", \"text\": <string>}}, got {shown(part)}",
                                    "malformed content part")
        if kind != "text":
            raise ConversationError(f"{where} has type {kind!r}: only text parts are supported (the model reads text)",
                                    "non-text content part")
        if not isinstance(part.get("text"), str):
            raise ConversationError(f"{where}: a text part needs \"text\": <string>", "malformed content part")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tokens(tokenizer, messages, add_generation_prompt: bool = False, template: str | None = None) -> ChatTokens:
    """The tokens of ``messages`` through the tokenizer's chat template (see the module docstring).

    Training form (default): the whole conversation plus EOD, with ``trained`` flags. With
    ``add_generation_prompt`` the prompt for the next assistant turn (nothing trained, no EOD).
    ``template``: a Jinja2 template used instead of the tokenizer's (a server's ``--chat-template``).
    """
    check_messages(messages, generation=add_generation_prompt)
    messages = [_encodable_message(m) for m in messages]
    if template is not None:
        template = (template, special_tokens(tokenizer))
    else:
        template = hf_chat_template(tokenizer)
    if template is None:
        out = _default_tokens(tokenizer, messages, add_generation_prompt)
    else:
        out = _template_tokens(tokenizer, template, messages, add_generation_prompt)
    if add_generation_prompt:
        out.trained = [False] * len(out.ids)
    eod = getattr(tokenizer, "eod", None)
    if not add_generation_prompt and eod is not None and (not out.ids or out.ids[-1] != eod):
        out.ids.append(int(eod))
        out.trained.append(True)
    return out


def _encodable_message(message: dict) -> dict:
    """The message with its text made UTF-8-encodable (a JSON "\\ud83d" escape: U+FFFD), as every
    tokenizer reads pretraining text: the Hugging Face tokenizer cannot take a lone surrogate."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": encodable(content)}
    if isinstance(content, list):
        parts = [{**p, "text": encodable(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                 for p in content]
        return {**message, "content": parts}
    return message


def encode(tokenizer, text: str) -> list[int]:
    """``text`` as token ids without the tokenizer's own additions (no BOS from a post-processor)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return hf.encode(text, add_special_tokens=False).ids
    if type(tokenizer).__name__ == "Llama2Tokenizer":  # its BOS (tokenize's keyword, as Megatron-LM's)
        return list(tokenizer.tokenize(text, bos=False))
    return list(tokenizer.tokenize(text))


def _default_tokens(tokenizer, messages, add_generation_prompt: bool) -> ChatTokens:
    ids, trained = [], []

    def add(text, learn):
        piece = encode(tokenizer, text)
        ids.extend(piece)
        trained.extend([learn] * len(piece))

    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            add(DEFAULT_HEADERS["assistant"], False)
            add(content_text(m["content"], i) + DEFAULT_SEPARATOR, True)
        else:
            add(DEFAULT_HEADERS[m["role"]] + content_text(m["content"], i) + DEFAULT_SEPARATOR, False)
    if add_generation_prompt:
        add(DEFAULT_HEADERS["assistant"], False)
    return ChatTokens(ids, trained)


# ---------------------------------------------------------------------------------------------
# Hugging Face chat templates.


def _tokenizer_config(folder: str) -> dict:
    """tokenizer_config.json over special_tokens_map.json (older repos name their special tokens only
    there; the tokenizer reads both the same way)."""
    config = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
            config.update(loaded if isinstance(loaded, dict) else {})
    return config


def hf_chat_template(tokenizer) -> tuple[str, dict] | None:
    """(template, special-token strings) of a Hugging Face tokenizer's folder, or None (no template:
    the default is used). Read once per tokenizer."""
    if not hasattr(tokenizer, "hf") or not getattr(tokenizer, "path", None):
        return None
    if not hasattr(tokenizer, "_chat_template"):
        folder = os.path.dirname(os.path.abspath(tokenizer.path))
        config = _tokenizer_config(folder)
        template = config.get("chat_template")
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        tokenizer._chat_template = (template, _specials(config)) if template else None
    return tokenizer._chat_template


def _specials(config: dict) -> dict:
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        out[key] = value.get("content", "") if isinstance(value, dict) else (value or "")
    return out


def special_tokens(tokenizer) -> dict:
    """The special-token strings a template may use (``bos_token``, ``eos_token``, ...): a Hugging
    Face tokenizer's ``tokenizer_config.json`` / ``special_tokens_map.json`` entries, else empty strings."""
    path = getattr(tokenizer, "path", None)
    config = _tokenizer_config(os.path.dirname(os.path.abspath(path))) if hasattr(tokenizer, "hf") and path else {}
    return _specials(config)


def compile_template(template: str) -> None:
    """Raise :class:`ConversationError` with jinja's reason if ``template`` does not parse."""
    import jinja2

    try:
        _compile(template)
    except jinja2.TemplateError as err:
        raise ConversationError(f"the chat template does not parse: {err}", "chat template") from None


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise ConversationError(f"the chat template refused the conversation: {message}", "chat template")

    class GenerationBlocks(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (Hugging Face marks assistant text with it for its
        assistant-token masks): rendered as its body; the trained tokens are found by prefixes here."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols, GenerationBlocks])
    env.filters["tojson"] = lambda value, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # Llama 3's "Today Date"
    return env.from_string(template)


@functools.lru_cache(maxsize=8)
def reads_parts(template: str) -> bool:
    """Whether ``template`` loops over a message's content (``{% for part in message['content'] %}``
    or ``message.content``, maybe through filters or a slice, or a name set to it: ``{% set content =
    message['content'] %}...{% for part in content %}``): such a template is given a content list
    as it came; any other gets the list's texts joined (:func:`content_text`), as vLLM detects it."""
    from jinja2 import nodes

    def is_content(node, names=frozenset()) -> bool:
        while isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem)
                                                                and isinstance(node.arg, nodes.Slice)):
            node = node.node
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        return (isinstance(node, nodes.Getattr) and node.attr == "content") or (isinstance(node, nodes.Name)
                                                                               and node.name in names)

    tree = _compile(template).environment.parse(template)
    # names set to a message's content ({% set content = message['content'] %}) read it as well
    names = {a.target.name for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name) and is_content(a.node)}
    return any(is_content(loop.iter, names) for loop in tree.find_all(nodes.For))


def _content_for(template: str, messages) -> list:
    """``messages`` as ``template`` takes them: content lists kept for a template that reads parts,
    else joined into strings (every list checked either way)."""
    lists = {i: content_text(m["content"], i) for i, m in enumerate(messages)
             if isinstance(m, dict) and isinstance(m.get("content"), list)}
    if not lists or reads_parts(template):
        return messages
    return [{**m, "content": lists[i]} if i in lists else m for i, m in enumerate(messages)]


def _render(template, messages, add_generation_prompt: bool) -> str:
    """The template's text for ``messages``; a template that does not parse or fails on them is a
    :class:`ConversationError` (the data readers add ``file:line``, the server answers HTTP 400)."""
    import jinja2

    text, specials = template
    try:
        messages = _content_for(text, messages)
        # no tools or documents (None, as Hugging Face passes them when none are given)
        return _compile(text).render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **specials)
    except jinja2.TemplateSyntaxError as err:
        raise ConversationError(f"the chat template does not parse: {err}", "chat template") from None
    except jinja2.TemplateError as err:
        raise ConversationError(f"the chat template failed on this conversation: {err}", "chat template") from None
    except ConversationError:  # raise_exception's: the template's own refusal
        raise
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as err:  # Python errors in the template
        raise ConversationError(f"the chat template failed on this conversation: {type(err).__name__}: {err}",
                                "chat template") from None


CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "  # Hugging Face's marker (continue_final_message)


def render_prompt(template, messages, add_generation_prompt: bool = True) -> str:
    """The text of ``messages`` for the model to continue, as Hugging Face's ``apply_chat_template(...,
    tokenize=False)`` renders it: with ``add_generation_prompt`` the next assistant turn's header after
    them; without (``continue_final_message``) the last message left open, the text cut right after
    its content (a marker appended to the content shows where; the template's end of turn is dropped;
    a list of parts left open is given as its joined text). A template that drops part of that content
    is a :class:`ConversationError`."""
    if add_generation_prompt:
        return _render(template, messages, True)
    last = content_text(messages[-1].get("content") if isinstance(messages[-1], dict) else None, len(messages) - 1)
    text = _render(template, [*messages[:-1], {**messages[-1], "content": last + CONTINUE_MARK}], False)
    mark = CONTINUE_MARK.strip()
    if last.strip() not in text or mark not in text:
        raise ConversationError("the chat template drops part of the final message, so it cannot be continued",
                                "chat template")
    at = text.rindex(mark)
    return text[:at] if text[at:at + len(CONTINUE_MARK)] == CONTINUE_MARK else text[:at].rstrip()


def _template_tokens(tokenizer, template, messages, add_generation_prompt: bool) -> ChatTokens:
    text = _render(template, messages, add_generation_prompt)
    if add_generation_prompt:  # nothing trained: any tokenizer (no offsets needed)
        ids = encode(tokenizer, text)
        return ChatTokens(ids, [False] * len(ids))
    spans = []
    if not add_generation_prompt:
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = _render(template, messages[:i], True)
            through = _render(template, messages[:i + 1], False)
            if not (text.startswith(through) and through.startswith(before)):
                raise ConversationError(
                    f"the tokenizer's chat template does not render this conversation prefix by prefix (turn {i}), "
                    "so its assistant tokens cannot be found; remove the template to use the default one",
                    "chat template")
            spans.append((len(before), len(through)))
    encoding = tokenizer.hf.encode(text, add_special_tokens=False)
    trained = [any(lo <= start < hi for lo, hi in spans) for start, _ in encoding.offsets]
    return ChatTokens(list(encoding.ids), trained)
