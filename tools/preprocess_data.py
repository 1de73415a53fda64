"""Turn JSONL into Megatron's .bin/.idx token files (Megatron-LM's flags; same bytes).

Example (the sample dataset of docs/data-and-tokenizers.md):
    python tools/preprocess_data.py --input data/sample.jsonl --output-prefix data/sample \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/spm4k.model \\
        --append-eod --workers 2
writes data/sample_text_document.bin/.idx.  The work is done by megatron_lite.data.preprocess.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.data.indexed_dataset import DataFileError, IndexedDataset  # noqa: E402
from megatron_lite.data.input_paths import output_prefix  # noqa: E402
from megatron_lite.data.interrupt import interrupted_exit_code, terminate_as_interrupt  # noqa: E402
from megatron_lite.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from megatron_lite.data.tokenizers import add_tokenizer_args, tokenizer_kwargs  # noqa: E402
from megatron_lite.errors import OneLineParser, run_tool  # noqa: E402


def dataset_impl(value: str) -> str:
    """Older Megatron-LM's --dataset-impl: mmap, the format always written, is taken (and changes nothing)."""
    if value != "mmap":
        raise argparse.ArgumentTypeError(
            f"{value!r} is an older Megatron-LM format that is not written here (the output is always the mmap "
            "format, MMIDIDX); use --dataset-impl mmap or drop it")
    return value


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file (one JSON object per line), optionally .gz; or a .parquet file or a "
                            "directory of them (needs pyarrow), --json-keys naming the columns")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence")
    group.add_argument("--keep-newlines", action="store_true",
                       help="keep newlines between sentences when splitting sentences")
    group.add_argument("--sentence-splitter", choices=["builtin", "nltk"], default="builtin",
                       help="builtin rule-based splitter (default, no download) or nltk punkt "
                            "(needs nltk and its punkt data installed)")
    add_tokenizer_args(parser)
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, type=output_prefix, help="outputs: PREFIX_{key}_{document|sentence}.bin/.idx")
    group.add_argument("--append-eod", action="store_true", help="append EOD to the end of each document")
    group.add_argument("--dataset-impl", type=dataset_impl, default="mmap",
                       help="accepted for older Megatron-LM scripts: it changes nothing, the output is always the "
                            "mmap format (MMIDIDX); lazy and cached are refused")
    group.add_argument("--lang", default="english", help="language for nltk punkt sentence splitting (--sentence-splitter nltk)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    group.add_argument("--partitions", type=int, default=1, help="process the input as N partitions, then merge")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress log lines")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="partitions take contiguous line ranges (document order kept) instead of round-robin")
    group.add_argument("--skip-malformed", action="store_true",
                       help="skip malformed lines (bad JSON, missing key, non-string value), report the count")
    group.add_argument("--no-progress", action="store_true", help="no progress bar, log lines instead")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = PreprocessConfig(
        input=args.input, output_prefix=args.output_prefix, tokenizer=tokenizer_kwargs(args),
        json_keys=args.json_keys, split_sentences=args.split_sentences, keep_newlines=args.keep_newlines,
        sentence_splitter=args.sentence_splitter, lang=args.lang, append_eod=args.append_eod,
        workers=args.workers, partitions=args.partitions,
        keep_sequential_samples=args.keep_sequential_samples, skip_malformed=args.skip_malformed,
        log_interval=args.log_interval, progress=False if args.no_progress else None,
    )
    try:
        with terminate_as_interrupt():  # kill / SIGTERM cleans up like Ctrl-C: no temporary files left
            result = preprocess(cfg)
    except (DataFileError, ValueError, ImportError, OSError, EOFError) as e:  # OSError: unreadable/bad .gz input
        print(f"error: {e}" if not isinstance(e, DataFileError) else str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print("interrupted: no output written", file=sys.stderr)
        return interrupted_exit_code(err)
    mb = result.bytes / 2**20
    print(f"Done: {result.documents} documents, {result.tokens} tokens, {mb:.1f} MB in {result.seconds:.1f} s "
          f"({result.documents / max(result.seconds, 1e-9):,.0f} docs/s, "
          f"{mb / max(result.seconds, 1e-9):.2f} MB/s)")
    if args.skip_malformed:
        print(f"Skipped {result.skipped} malformed lines")
    for prefix in result.outputs:
        print(f"Wrote {prefix}.bin and {prefix}.idx")
    for key, prefix in zip(args.json_keys, result.outputs):
        if IndexedDataset(prefix).num_tokens == 0:  # written as Megatron-LM does, but training refuses it
            print(f"warning: no tokens written to {prefix}: the {key!r} field of every document in {args.input} is empty; "
                  "check --json-keys", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
