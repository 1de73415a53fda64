"""Chat templates: turning ``[{"role", "content"}, ...]`` into the prompt text a chat model expects.

The template is the Jinja2 ``chat_template`` of a Hugging Face ``tokenizer_config.json`` (found next
to the checkpoint's tokenizer files, or in ``<checkpoint>/tokenizer/``), or a template file given
with ``--chat-template``. It is rendered in a sandbox the way ``transformers`` renders it: with
``messages``, ``add_generation_prompt=True``, the ``bos_token`` / ``eos_token`` strings of the
config and ``raise_exception``. Jinja2 comes with Flask (the ``serve`` extra).
"""

from __future__ import annotations

import json
import os

from ..errors import ConfigError

CONFIG_NAME = "tokenizer_config.json"


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content", "")
    return value or ""


def find_template(saved: dict, load: str) -> tuple[str | None, dict]:
    """(template, tokenizer config) from the tokenizer_config.json beside the checkpoint's tokenizer
    files, or (None, {})."""
    folders = [os.path.join(load, "tokenizer")]
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        if saved.get(key):
            folders.append(os.path.dirname(os.path.abspath(saved[key])))
    for folder in folders:
        path = os.path.join(folder, CONFIG_NAME)
        if os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
            template = config.get("chat_template")
            if isinstance(template, list):  # named templates: the default one
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
            if template:
                return template, config
    return None, {}


def make_renderer(template: str, config: dict | None = None):
    """``render(messages) -> str`` for a Jinja2 chat template."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install megatron_lite[serve]") from None

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except TemplateError as err:
        raise ConfigError(f"the chat template does not parse: {err}") from None
    config = config or {}
    tokens = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}

    def render(messages: list[dict]) -> str:
        from .fields import RequestError

        try:
            return compiled.render(messages=messages, add_generation_prompt=True, **tokens)
        except TemplateError as err:
            raise RequestError(f"the chat template refused the messages: {err}") from None

    return render


def load_renderer(template_file: str | None, saved: dict, load: str):
    """The renderer of ``--chat-template`` or of the checkpoint's tokenizer config, or None."""
    if template_file:
        if not os.path.isfile(template_file):
            raise ConfigError(f"--chat-template {template_file} does not exist")
        with open(template_file) as f:
            return make_renderer(f.read(), find_template(saved, load)[1])
    template, config = find_template(saved, load)
    return make_renderer(template, config) if template else None
