"""Zero-shot evaluation without a harness: perplexity over overlapping windows (with Megatron's
word-level adjustment) and LAMBADA-style last-word accuracy. Used by tools/evaluate.py.

Perplexity (Megatron's WIKITEXT103 evaluation). The text's ``T`` tokens are scored in windows of
``seq_length + 1`` tokens starting every ``stride`` (``--overlapping-eval``) tokens: the first
window scores all its targets, every later one only its last ``stride`` targets, so each of the
``T - 1`` targets is scored exactly once with at least ``seq_length - stride`` tokens of context.
Then ``loss = sum(NLL) / (T - 1)``, ``ppl = exp(min(20, loss))`` and, when the text's word count
``W`` is known, ``adjusted ppl = exp(min(20, sum(NLL) / (W - 1)))`` (perplexity per word, comparable
across tokenizers) with ``token ratio = (T - 1) / (W - 1)``. As in Megatron, ``T`` counts every token
of the scored stream and ``W`` only the raw text's words: a JSONL file's end-of-document tokens (one
after each document) are in ``T`` and in ``sum(NLL)`` (predicting a document's end is part of the
cost), as Megatron's newline tokens are, and in no word; the adjusted ppl is that total per word.

LAMBADA: predict the last word of each text from the rest. Non-strict (Megatron's default) the
target is the text's last token; with ``strict`` it is the last whitespace-separated word,
tokenized as it follows the context ``text[:start of word]`` (stripped): the tokens of
``context + " " + word`` after the context's (Megatron's ``" " + word`` for GPT-2 BPE; without a
second space for SentencePiece), possibly several. An example is correct when every target token
is the argmax under teacher forcing.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from ..data.chat_template import encode
from ..progress import progress as progress_bar


@dataclass
class Perplexity:
    loss: float
    ppl: float
    num_tokens: int  # T
    num_words: int | None  # W (None when only tokens are known)

    @property
    def token_ratio(self) -> float | None:
        return None if not self.num_words else (self.num_tokens - 1) / max(self.num_words - 1, 1)

    @property
    def adjusted_ppl(self) -> float | None:
        ratio = self.token_ratio
        return None if ratio is None else math.exp(min(20.0, self.loss * ratio))

    def line(self, task: str = "WIKITEXT103") -> str:
        words = (f" | adjusted ppl: {self.adjusted_ppl:.4E} | token ratio: {self.token_ratio:.4E} |"
                 if self.num_words else " | adjusted ppl: n/a (no word count: token input) |")
        return f"validation results on {task} | avg loss: {self.loss:.4E} | ppl: {self.ppl:.4E}{words}"


def windows(num_tokens: int, seq_length: int, stride: int) -> list[tuple[int, int]]:
    """``(start, first scored target)`` of every window: targets ``start + 1 ... start + seq_length``,
    of which those at window offset ``>= first`` are scored (0 for the first window)."""
    if not 0 < stride <= seq_length:
        raise ValueError(f"--overlapping-eval {stride} must be in [1, seq length {seq_length}]")
    targets = num_tokens - 1
    count = max(math.ceil(max(targets - stride, 0) / stride) + 1, 1)
    out = [(i * stride, 0 if i == 0 else seq_length - stride) for i in range(count)]
    return [(start, first) for start, first in out if start + first < targets]  # windows with something to score


def perplexity(engine, tokens: list[int], seq_length: int, stride: int, num_words: int | None = None,
               batch_size: int = 8, progress: bool = True) -> Perplexity:
    """Perplexity of the token stream ``tokens`` (see the module docstring)."""
    if len(tokens) < 2:
        raise ValueError(f"the text has {len(tokens)} token(s); perplexity needs at least 2")
    spans = windows(len(tokens), seq_length, stride)
    nll, scored = 0.0, 0
    for i in progress_bar(range(0, len(spans), batch_size), enabled=progress, desc="windows", unit="batch"):
        batch = spans[i:i + batch_size]
        results = engine.score([tokens[start:start + seq_length + 1] for start, _ in batch])
        for (_, first), result in zip(batch, results):
            values = result.log_probs[first:]
            nll -= sum(values)
            scored += len(values)
    if scored != len(tokens) - 1:  # every target exactly once
        raise AssertionError(f"scored {scored} targets of {len(tokens) - 1}")
    loss = nll / (len(tokens) - 1)
    return Perplexity(loss, math.exp(min(20.0, loss)), len(tokens), num_words)


def lambada_example(tokenizer, text: str, strict: bool) -> tuple[list[int], int]:
    """(context + target tokens, number of target tokens) of one LAMBADA text."""
    if not text.split():
        raise ValueError(f"a LAMBADA text is empty: {text!r}")
    if not strict:
        tokens = tokenizer.tokenize(text)
        return tokens, 1
    word = text.split()[-1]
    before = text[:text.rfind(word)].strip()
    context = tokenizer.tokenize(before)
    # the word's tokens as they follow the context (no BOS a tokenizer.json's post-processor adds): the
    # tokens of context + " " + word after the context's. " " + word alone is the same for GPT-2 BPE, but
    # a SentencePiece model's dummy prefix makes it "▁" "▁word", a second space the text does not have
    joined, alone = encode(tokenizer, before + " " + word), encode(tokenizer, before)
    target = joined[len(alone):] if joined[:len(alone)] == alone else []
    target = target or encode(tokenizer, " " + word)  # the context's last token merged with the word
    return context + target, len(target)


def lambada_accuracy(engine, tokenizer, texts: list[str], seq_length: int, strict: bool = False,
                     batch_size: int = 8, progress: bool = True) -> tuple[int, int]:
    """(number correct, total) of last-word prediction over ``texts``."""
    examples = []
    for text in texts:
        tokens, n = lambada_example(tokenizer, text, strict)
        if len(tokens) <= n:
            raise ValueError(f"a LAMBADA text has no context before its last word: {text[:60]!r}")
        examples.append((tokens[-(seq_length + 1):], n))
    correct = 0
    for i in progress_bar(range(0, len(examples), batch_size), enabled=progress, desc="examples", unit="batch"):
        batch = examples[i:i + batch_size]
        for (_, n), result in zip(batch, engine.score([tokens for tokens, _ in batch])):
            correct += all(result.greedy[-n:])
    return correct, len(examples)


# ---------------------------------------------------------------------------------------------
# Reading the evaluation data.


def read_jsonl_texts(path: str, key: str = "text") -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[key]
            except (json.JSONDecodeError, KeyError, TypeError):
                text = None
            if not isinstance(text, str):
                raise ValueError(f"{path} line {number} is not a JSON object with a {key!r} string")
            texts.append(text)
    if not texts:
        raise ValueError(f"{path} holds no text")
    return texts


def word_count(text: str) -> int:
    """Megatron's word count: the pieces of the stripped text split on single spaces (none in a text of
    whitespace only, where Megatron's split would count one: an empty JSONL document adds no word)."""
    text = text.strip()
    return len(text.split(" ")) if text else 0


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenization (`` @-@ `` -> ``-``, spaces before punctuation, ``= = =`` ...)."""
    for old, new in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "), (" . ", ". "),
                     (" ! ", "! "), (" ? ", "? "), (" , ", ", "), (" 's", "'s"), ("= = = =", "===="),
                     ("= = =", "==="), ("= =", "==")):
        text = text.replace(old, new)
    text = re.sub(r"\(\s*([^)]*?)\s*\)", r"(\1)", text)
    text = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", text)
    return text.replace(" \n", "\n").replace("\n ", "\n")


def check_data_path(path: str) -> None:
    """ValueError unless ``path`` is a file or a .bin/.idx dataset prefix (before loading any model)."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if not os.path.isfile(path) and not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        raise ValueError(f"--valid-data {path}: no such file (nor {prefix}.bin/.idx)")


def read_token_stream(path: str, tokenizer, key: str = "text", detokenize: bool = False) -> tuple[list[int], int | None]:
    """(tokens, word count or None) of an evaluation file: a .bin/.idx dataset prefix (its documents
    as stored; no word count), a JSONL file (each ``key`` tokenized, end-of-document after each), or
    plain text (the whole file, as Megatron reads WikiText)."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        from ..data.indexed_dataset import IndexedDataset

        data = IndexedDataset(prefix)
        tokens = [int(t) for i in range(len(data)) for t in data[i]]
        return tokens, None
    check_data_path(path)
    if path.endswith((".jsonl", ".json")):
        raw_texts = read_jsonl_texts(path, key)
        tokens = []
        for raw in raw_texts:
            text = wikitext_detokenize(raw) if detokenize else raw
            tokens += tokenizer.tokenize(text) + ([tokenizer.eod] if tokenizer.eod is not None else [])
        return tokens, sum(word_count(t) for t in raw_texts)
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    text = wikitext_detokenize(raw) if detokenize else raw
    return tokenizer.tokenize(text), word_count(raw)
