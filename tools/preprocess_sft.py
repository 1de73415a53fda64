"""Tokenize chat conversations (JSONL) once, for ``pretrain_gpt.py --sft --data-path PREFIX``.

    python tools/preprocess_sft.py --input chats.jsonl --output-prefix data/chats \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model my-model/ --seq-length 2048 --workers 4
writes data/chats.bin/.idx (tokens, one sequence per conversation) and data/chats_loss_mask.bin/.idx
(1 where the token is learned). Lines are {"messages": [{"role": ..., "content": ...}, ...]} or
{"prompt": ..., "response": ...}; the chat template and checks are --sft's (docs/fine-tuning.md).
The work is done by megatron_lite.data.sft_preprocess.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.data.builder import DataConfigError  # noqa: E402
from megatron_lite.data.indexed_dataset import DataFileError  # noqa: E402
from megatron_lite.data.input_paths import output_prefix  # noqa: E402
from megatron_lite.data.interrupt import interrupted_exit_code, terminate_as_interrupt  # noqa: E402
from megatron_lite.data.sft_preprocess import preprocess_sft  # noqa: E402
from megatron_lite.data.tokenizers import add_tokenizer_args, tokenizer_kwargs  # noqa: E402
from megatron_lite.errors import ConfigError, OneLineParser, run_tool  # noqa: E402


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSONL file of conversations (optionally .gz)")
    parser.add_argument("--output-prefix", required=True, type=output_prefix, help="outputs: PREFIX.bin/.idx and PREFIX_loss_mask.bin/.idx")
    add_tokenizer_args(parser)
    parser.add_argument("--seq-length", type=int, default=None,
                        help="refuse conversations longer than this + 1 tokens now (else when training)")
    parser.add_argument("--sft-skip-bad-conversations", action="store_true",
                        help="skip (and count) bad conversations instead of stopping at the first")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        with terminate_as_interrupt():  # kill / SIGTERM cleans up like Ctrl-C: no temporary files left
            result = preprocess_sft(
                args.input, args.output_prefix, tokenizer_kwargs(args), workers=args.workers,
                max_tokens=None if args.seq_length is None else args.seq_length + 1,
                skip_bad=args.sft_skip_bad_conversations, progress=False if args.no_progress else None)
    except (DataFileError, DataConfigError, ConfigError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print("interrupted: no output written", file=sys.stderr)
        return interrupted_exit_code(err)
    print(f"Done: {result.conversations} conversations, {result.tokens} tokens "
          f"({result.trained_tokens} learned)")
    if result.skipped:
        reasons = ", ".join(f"{n} {reason}" for reason, n in result.skipped.most_common())
        print(f"Skipped {sum(result.skipped.values())} bad conversations ({reasons})")
    print(f"Wrote {args.output_prefix}.bin/.idx and {args.output_prefix}_loss_mask.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
