"""Zero-shot evaluation of a megatron_lite GPT checkpoint without a harness (Megatron's tasks/main.py).

    # perplexity over a .bin/.idx dataset, a JSONL file ("text" per line) or a plain text file,
    # with overlapping windows and (for text) the word-level adjusted perplexity
    python tools/evaluate.py --task WIKITEXT103 --valid-data wiki.test.tokens --load ckpt --overlapping-eval 32
    # LAMBADA last-word accuracy on a JSONL file ("text" per line); --strict-lambada: the whole last word
    python tools/evaluate.py --task LAMBADA --valid-data lambada_test.jsonl --load ckpt --strict-lambada

Runs in one process or under torchrun at the checkpoint's TP x PP, like tools/generate.py. The
formulas are in megatron_lite/inference/evaluation.py; see docs/inference.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.errors import OneLineParser, run_tool  # noqa: E402
from megatron_lite.inference.cli import USER_ERRORS, add_inference_args, build_session, fail  # noqa: E402
from megatron_lite.inference.evaluation import (  # noqa: E402
    check_data_path,
    lambada_accuracy,
    perplexity,
    read_jsonl_texts,
    read_token_stream,
)

TASKS = ("WIKITEXT103", "PERPLEXITY", "LAMBADA")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.set_defaults(purpose="evaluation")  # what a BERT checkpoint's refusal names (build_session)
    p.add_argument("--task", required=True, choices=TASKS,
                   help="WIKITEXT103 (= PERPLEXITY): perplexity of a text; LAMBADA: last-word accuracy")
    p.add_argument("--valid-data", required=True, nargs="+",
                   help="the evaluation file: .bin/.idx prefix, .jsonl, or plain text (perplexity); .jsonl (LAMBADA)")
    p.add_argument("--overlapping-eval", type=int, default=32,
                   help="window stride: each window after the first scores only its last N tokens")
    p.add_argument("--strict-lambada", action="store_true", help="LAMBADA target = the whole last word")
    p.add_argument("--seq-length", type=int, default=None, help="window length (default: the model's context)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="windows or examples per forward pass")
    p.add_argument("--json-key", default="text", help="the JSONL field holding the text")
    p.add_argument("--wikitext-detokenize", action="store_true",
                   help="undo WikiText's tokenization (' @-@ ' -> '-', ...) before tokenizing")
    add_inference_args(p)
    args = p.parse_args(argv)
    if len(args.valid_data) != 1:
        p.error("--valid-data takes exactly one file")
    return args


def run(args, session) -> str:
    engine, tokenizer = session.engine, session.tokenizer
    seq = args.seq_length or engine.max_sequence_length
    if not 0 < seq <= engine.max_sequence_length:
        raise ValueError(f"--seq-length {seq} must be in [1, {engine.max_sequence_length}] (the model's context)")
    show = session.is_rank0
    path = args.valid_data[0]
    if args.task == "LAMBADA":
        if path.endswith((".bin", ".idx")):
            raise ValueError("LAMBADA needs a JSONL file with the texts (not a .bin/.idx dataset)")
        correct, total = lambada_accuracy(engine, tokenizer, read_jsonl_texts(path, args.json_key), seq,
                                          args.strict_lambada, args.micro_batch_size, show)
        return (f"validation results on LAMBADA | number correct: {correct} | total examples: {total} | "
                f"avg accuracy: {correct / total:.4E}")
    tokens, words = read_token_stream(path, tokenizer, args.json_key, args.wikitext_detokenize)
    result = perplexity(engine, tokens, seq, args.overlapping_eval, words, args.micro_batch_size, show)
    return result.line(args.task)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_data_path(args.valid_data[0])
        if args.overlapping_eval < 1:
            raise ValueError(f"--overlapping-eval {args.overlapping_eval} must be at least 1")
        if args.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size {args.micro_batch_size} must be at least 1")
        session = build_session(args)
        line = run(args, session)
    except USER_ERRORS as err:
        return fail(err)
    if session.is_rank0:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
