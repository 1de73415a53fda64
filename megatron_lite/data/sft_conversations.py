"""SFT conversations, tokenized: from JSONL (checked, through the chat template) or from the indexed
files ``tools/preprocess_sft.py`` writes.

A JSONL line is one conversation, ``{"messages": [{"role": ..., "content": ...}, ...]}``, or the
prompt/response form ``{"prompt": ..., "response": ...}`` (optionally with ``"system"``), which is
the conversation system?, user, assistant. Each becomes token ids plus one flag per token: True
where the model learns that token (:func:`~megatron_lite.data.chat_template.chat_tokens`).

A bad line (not JSON, neither form, unknown role, assistant turn first, empty assistant turn, no
assistant turn, longer than ``max_tokens``) raises :class:`~megatron_lite.data.builder.DataConfigError`
naming ``file:line``; with ``skip_bad`` it is counted by reason and left out.

The indexed form is a pair of Megatron ``.bin/.idx`` datasets with one sequence per conversation:
``PREFIX`` (token ids) and ``PREFIX_loss_mask`` (uint8, 1 where the token is learned).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections import Counter

import numpy as np

from megatron_lite.data.builder import DataConfigError
from megatron_lite.data.chat_template import ConversationError, chat_tokens
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDataset, index_file_path
from megatron_lite.data.input_paths import PAIR, folder_not_prefix, not_an_input_file

LOSS_MASK_SUFFIX = "_loss_mask"
SKIP_FLAG = "--sft-skip-bad-conversations"


def messages_of(line: bytes | str) -> list:
    """The messages of one JSONL line (either form); ConversationError if it is neither."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConversationError(f"not valid JSON ({getattr(err, 'msg', err)})", "not JSON") from None
    except RecursionError:
        raise ConversationError("not valid JSON (nested too deeply to read)", "not JSON") from None
    if isinstance(record, dict) and "messages" in record:
        return record["messages"]
    if isinstance(record, dict) and "prompt" in record and "response" in record:
        system = [{"role": "system", "content": record["system"]}] if "system" in record else []
        return system + [{"role": "user", "content": record["prompt"]},
                         {"role": "assistant", "content": record["response"]}]
    raise ConversationError('expected {"messages": [...]} or {"prompt": ..., "response": ...}', "neither form")


class Conversations:
    """Tokenized conversations: ``get(i) -> (tokens int64 [n], trained bool [n])``, ``lengths``,
    ``where(i)`` (``file:line`` for error messages) and the per-reason ``skipped`` counts."""

    def __init__(self, source: str, lengths, get, where, skipped: Counter | None = None):
        self.source, self.lengths, self.get, self.where = source, np.asarray(lengths, dtype=np.int64), get, where
        self.skipped = skipped or Counter()

    def __len__(self) -> int:
        return len(self.lengths)


def _too_long(n: int, max_tokens: int) -> ConversationError:
    return ConversationError(f"conversation is {n} tokens, longer than --seq-length {max_tokens - 1} + 1 "
                             "(or raise --seq-length)", "longer than the sequence")


def bad_conversation(where: str, err: ConversationError) -> DataConfigError:
    return DataConfigError(f"{where}: {err}; fix it, or pass {SKIP_FLAG} to skip bad conversations")


def encode_line(raw: bytes | str, tokenizer, max_tokens: int | None = None):
    """One JSONL line's conversation as ChatTokens (ConversationError when it is bad)."""
    chat = chat_tokens(tokenizer, messages_of(raw))
    if max_tokens is not None and len(chat) > max_tokens:
        raise _too_long(len(chat), max_tokens)
    return chat


def open_jsonl(path: str, flag: str = "--data-path"):
    """``path`` opened for reading bytes (``.gz`` decompressed)."""
    if not os.path.isfile(path):
        if flag == "--input":  # tools/preprocess_sft.py: a folder of shards, a quoted glob
            raise DataFileError(not_an_input_file(path, flag, parquet=False))
        if os.path.isdir(path):
            raise DataFileError(folder_not_prefix(path, f"a JSONL file nor {PAIR}"))
        raise DataFileError(f"{path}: file not found ({flag})")
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def jsonl_lines(path: str, flag: str = "--data-path"):
    """``(line number, bytes)`` of every line of ``path``; a file that cannot be read or decompressed
    (a truncated or corrupt ``.gz``) is a DataFileError naming it and the last good line."""
    lineno, first = 0, True
    try:
        with open_jsonl(path, flag) as f:
            for lineno, raw in enumerate(f, 1):
                if first and raw.strip():
                    _refuse_json_array(path, lineno, raw, flag)
                    first = False
                yield lineno, raw
    except (OSError, EOFError, zlib.error) as err:
        where = f"after line {lineno}" if lineno else "from its start"
        damaged = isinstance(err, (gzip.BadGzipFile, EOFError, zlib.error))
        hint = ": the file is truncated, corrupt, or not the gzip its name says" if damaged else ""
        raise DataFileError(f"{path}: cannot be read {where} ({err}){hint} ({flag})") from None


def _refuse_json_array(path: str, lineno: int, raw: bytes, flag: str) -> None:
    """A first line starting with '[' is a JSON array of conversations (pretty-printed or on one line),
    which no line-by-line reading takes: one DataFileError saying the file must be JSONL and how to convert it."""
    if not raw.lstrip(b"\xef\xbb\xbf").strip().startswith(b"["):
        return
    base = path[: -len(".gz")] if path.endswith(".gz") else path
    base = base.rsplit(".", 1)[0] if base.endswith((".json", ".jsonl")) else base
    out = base + ".jsonl" if base + ".jsonl" != path else base + "_lines.jsonl"
    jq = f"gzip -dc {path} | jq -c '.[]' > {out}" if path.endswith(".gz") else f"jq -c '.[]' {path} > {out}"
    py = "python -c \"import json,sys; [print(json.dumps(c)) for c in json.load(sys.stdin)]\""
    raise DataFileError(
        f"{path}: line {lineno} starts a JSON array, but SFT data is JSONL (one conversation per line); convert it "
        f"with {jq}" + ("" if path.endswith(".gz") else f" (or {py} < {path} > {out})") + f" and pass {out} ({flag})")


def read_jsonl(path: str, tokenizer, max_tokens: int | None = None, skip_bad: bool = False) -> Conversations:
    """Every conversation of the JSONL file ``path`` (blank lines ignored), tokenized and checked."""
    tokens, trained, lines, skipped = [], [], [], Counter()
    for lineno, raw in jsonl_lines(path):
        if not raw.strip():
            continue
        try:
            chat = encode_line(raw, tokenizer, max_tokens)
        except ConversationError as err:
            if not skip_bad:
                raise bad_conversation(f"{path}:{lineno}", err) from None
            skipped[err.reason] += 1
            continue
        tokens.append(np.asarray(chat.ids, dtype=np.int64))
        trained.append(np.asarray(chat.trained, dtype=bool))
        lines.append(lineno)
    return Conversations(path, [len(t) for t in tokens], lambda i: (tokens[i], trained[i]),
                         lambda i: f"{path}:{lines[i]}", skipped)


def is_indexed(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix))


def read_indexed(prefix: str, max_tokens: int | None = None, skip_bad: bool = False,
                 mmap_bin: bool = True) -> Conversations:
    """The conversations of ``PREFIX.bin/.idx`` + ``PREFIX_loss_mask.bin/.idx`` (checked to agree)."""
    try:
        tokens, masks = IndexedDataset(prefix, mmap_bin), IndexedDataset(prefix + LOSS_MASK_SUFFIX, mmap_bin)
    except DataFileError as err:
        raise DataFileError(f"--data-path (SFT): {err}; write both files with tools/preprocess_sft.py") from None
    if not np.array_equal(tokens.sequence_lengths, masks.sequence_lengths):
        raise DataFileError(f"--data-path {prefix}: {prefix}{LOSS_MASK_SUFFIX}.idx does not describe the same "
                            "conversations as the token files; write both again with tools/preprocess_sft.py")
    keep = np.arange(len(tokens))
    skipped = Counter()
    if max_tokens is not None:
        long = tokens.sequence_lengths > max_tokens
        if long.any() and not skip_bad:
            i = int(np.argmax(long))
            raise bad_conversation(f"{prefix}.bin conversation {i}", _too_long(int(tokens.sequence_lengths[i]), max_tokens))
        keep, skipped["longer than the sequence"] = np.flatnonzero(~long), int(long.sum())
    return Conversations(prefix, tokens.sequence_lengths[keep],
                         lambda i: (tokens.get(int(keep[i])).astype(np.int64), masks.get(int(keep[i])).astype(bool)),
                         lambda i: f"{prefix}.bin conversation {int(keep[i])}", +skipped)


def read_conversations(path: str, tokenizer, max_tokens: int | None = None, skip_bad: bool = False,
                       mmap_bin: bool = True) -> Conversations:
    """A JSONL file (``.jsonl`` / ``.json`` / ``.gz``) or an indexed prefix written by tools/preprocess_sft.py
    (its .bin files memory-mapped, or read with file reads when not ``mmap_bin``)."""
    if is_indexed(path) and not path.endswith((".jsonl", ".json", ".gz")):
        return read_indexed(path, max_tokens, skip_bad, mmap_bin)
    return read_jsonl(path, tokenizer, max_tokens, skip_bad)
