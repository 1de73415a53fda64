"""Tiny SFT fixtures: a word-level Hugging Face tokenizer (with or without a chat template) and
deterministic random conversations over its words, as JSONL."""

from __future__ import annotations

import json
import os
import random

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "red", "green", "blue",
         "cat", "dog", "sun", "moon", "yes", "no", "why", "how", "what", ".", "?", ",", "!"]
SPECIAL = ["<unk>", "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HEADER_WORDS = ["System", "User", "Assistant", ":", "system", "user", "assistant"]
VOCAB = SPECIAL + HEADER_WORDS + WORDS  # 38 tokens

# ChatML, the form most Hugging Face chat models use (Qwen, ...).
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


CHAT = [{"role": "system", "content": "red"}, {"role": "user", "content": "why ?"},
        {"role": "assistant", "content": "sun moon"}, {"role": "user", "content": "how"},
        {"role": "assistant", "content": "no"}]


def hf_tokenizers(root) -> dict:
    """The tests' two Hugging Face tokenizers in ``root``: the default template's and ChatML's."""
    from megatron_lite.data.tokenizers import build_tokenizer

    return {name: build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(root / name, template))
            for name, template in (("default", None), ("chatml", CHATML))}


def write_tokenizer(folder, chat_template: str | None = None) -> str:
    """A word-level ``tokenizer.json`` in ``folder`` (and a ``tokenizer_config.json`` holding
    ``chat_template`` when given); returns the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    if chat_template is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": chat_template, "eos_token": "<|endoftext|>", "pad_token": "<pad>"}, f)
    return str(folder)


def _text(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversation(rng, max_turns=2, max_words=4) -> dict:
    """A random conversation: maybe a system message, then user/assistant turns."""
    messages = [{"role": "system", "content": _text(rng, 1, 3)}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, max_turns)):
        messages += [{"role": "user", "content": _text(rng, 1, max_words)},
                     {"role": "assistant", "content": _text(rng, 1, max_words)}]
    return {"messages": messages}


def write_conversations(path, n: int, seed: int = 0, **kw) -> str:
    """``n`` random conversations as JSONL (every 5th in the prompt/response form)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            record = conversation(rng, **kw)
            if i % 5 == 4:
                record = {"prompt": _text(rng, 1, 4), "response": _text(rng, 1, 4)}
            f.write(json.dumps(record) + "\n")
    return str(path)
