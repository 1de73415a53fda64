"""Chat JSONL -> indexed SFT files, tokenized once: the engine behind ``tools/preprocess_sft.py``.

Writes ``PREFIX.bin/.idx`` (token ids, one sequence and one document per conversation, Megatron's
format) and ``PREFIX_loss_mask.bin/.idx`` (uint8, 1 where the token is learned), both under
temporary names renamed only when the whole input succeeded. Every line goes through the same
check and chat template as ``--sft`` reading JSONL directly
(:func:`~megatron_lite.data.sft_conversations.encode_line`), so ``--data-path PREFIX`` trains on
exactly the tokens the JSONL would give. Workers tokenize chunks of lines in parallel, in input
order (1 and N workers write the same bytes); a tqdm bar follows the bytes read.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from megatron_lite.data.chat_template import ConversationError
from megatron_lite.data.indexed_dataset import best_dtype, building_together
from megatron_lite.data.interrupt import workers_ignore_ctrl_c
from megatron_lite.data.sft_conversations import LOSS_MASK_SUFFIX, bad_conversation, encode_line, jsonl_lines
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.data.worker_pool import ChunkGate, stop_pool
from megatron_lite.errors import ConfigError
from megatron_lite.progress import progress as progress_bar

CHUNK_LINES = 256
_worker = {}


@dataclass
class SFTPreprocessResult:
    conversations: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    skipped: Counter = field(default_factory=Counter)


def _init(tokenizer_kwargs: dict, max_tokens: int | None) -> None:
    _worker["tokenizer"] = build_tokenizer(**tokenizer_kwargs)
    _worker["max_tokens"] = max_tokens


def _init_worker(tokenizer_kwargs: dict, max_tokens: int | None) -> None:
    """A pool worker: ignores Ctrl-C (also if the pool starts it later, outside ``workers_ignore_ctrl_c``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init(tokenizer_kwargs, max_tokens)


def _encode_chunk(chunk):
    """[(line number, ids, trained) or (line number, ConversationError)] for a chunk of lines, and its bytes."""
    out, nbytes = [], 0
    for lineno, raw in chunk:
        nbytes += len(raw)
        if not raw.strip():
            continue
        try:
            chat = encode_line(raw, _worker["tokenizer"], _worker["max_tokens"])
            out.append((lineno, np.asarray(chat.ids), np.asarray(chat.trained, dtype=np.uint8)))
        except ConversationError as err:
            out.append((lineno, err))
    return out, nbytes


def _chunks(path: str):
    chunk = []
    for lineno, raw in jsonl_lines(path, "--input"):
        chunk.append((lineno, raw))
        if len(chunk) == CHUNK_LINES:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def preprocess_sft(input_path: str, output_prefix: str, tokenizer_kwargs: dict, workers: int = 1,
                   max_tokens: int | None = None, skip_bad: bool = False, progress: bool | None = None
                   ) -> SFTPreprocessResult:
    """Tokenize every conversation of ``input_path`` into the two indexed datasets of ``output_prefix``.

    A bad line raises DataConfigError naming ``file:line`` (nothing is written) unless ``skip_bad``;
    ``max_tokens`` (--seq-length + 1) also refuses conversations longer than that."""
    if tokenizer_kwargs.get("tokenizer_type") == "NullTokenizer":  # as --sft refuses it (sft_dataset.check_sft_flags)
        raise ConfigError("--tokenizer-type NullTokenizer reads token ids, not chat text; use the text tokenizer "
                          "the fine-tune will use")
    if workers < 1:  # no worker would take a chunk: the run waited forever
        raise ConfigError(f"--workers {workers} must be at least 1")
    _init(tokenizer_kwargs, max_tokens)
    result = SFTPreprocessResult()
    dtype = best_dtype(_worker["tokenizer"].vocab_size)
    plain = os.path.isfile(input_path) and not input_path.endswith(".gz")
    bar = progress_bar(total=os.path.getsize(input_path) if plain else None, unit="B", unit_scale=True,
                       desc="conversations", enabled=progress is not False)  # a bar, or log lines (no terminal)
    pool = None
    if workers > 1:
        with workers_ignore_ctrl_c():  # Ctrl-C: the main process cleans up and says so in one line; workers stay quiet
            pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer_kwargs, max_tokens))
    gate = ChunkGate(_chunks(input_path), 4 * workers)  # at most this many chunks in flight: bounded memory
    try:
        # both or neither: a loss mask beside tokens of another run would train on the wrong positions
        with building_together([(output_prefix, dtype), (output_prefix + LOSS_MASK_SUFFIX, np.uint8)]) as (tokens, masks):
            for encoded, nbytes in (pool.imap(_encode_chunk, gate) if pool else map(_encode_chunk, gate)):
                gate.done_one()
                for lineno, *rest in encoded:
                    if isinstance(rest[0], ConversationError):
                        if not skip_bad:
                            raise bad_conversation(f"{input_path}:{lineno}", rest[0])
                        result.skipped[rest[0].reason] += 1
                        continue
                    ids, trained = rest
                    tokens.add_document(ids, [len(ids)])
                    masks.add_document(trained, [len(trained)])
                    result.conversations += 1
                    result.tokens += len(ids)
                    result.trained_tokens += int(trained.sum())
                bar.update(nbytes)
    finally:
        gate.stop()
        bar.close()
        if pool is not None:
            stop_pool(pool)  # bounded: Pool.terminate alone can wait forever (see stop_pool)
    return result
