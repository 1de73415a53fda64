"""Concatenate every .bin/.idx dataset in a directory (sorted by name) into one dataset.

    python tools/merge_datasets.py --input data/shards --output-prefix data/merged_text_document

The .bin files are streamed in 16 MiB blocks (memory stays bounded whatever their size); only the
indexes are held in memory.  All inputs must share one token dtype, and either all or none carry
Megatron's multimodal sequence modes (kept in the output's .idx).  The output is written under
temporary names and renamed at the end, so a failed merge leaves nothing behind.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.data.indexed_dataset import (  # noqa: E402
    DataFileError,
    IndexedDataset,
    IndexedDatasetBuilder,
    index_file_path,
)
from megatron_lite.data.input_paths import output_prefix  # noqa: E402
from megatron_lite.data.interrupt import interrupted_exit_code, terminate_as_interrupt  # noqa: E402
from megatron_lite.errors import OneLineParser, run_tool  # noqa: E402


def find_datasets(directory: str) -> list[str]:
    """Prefixes of the .bin/.idx pairs in ``directory``, sorted by name. Either file without the other
    is an error (as in Megatron-LM): a shard missing half of its pair is never left out silently."""
    if not os.path.isdir(directory):
        raise DataFileError(f"{directory}: not a directory (--input)")
    prefixes = []
    for name in sorted(os.listdir(directory)):
        stem, ext = os.path.splitext(name)
        if ext not in (".bin", ".idx") or name.startswith("."):
            continue
        prefix = os.path.join(directory, stem)
        other = ".bin" if ext == ".idx" else ".idx"
        if not os.path.isfile(prefix + other):
            what = "index" if ext == ".idx" else "data file"
            raise DataFileError(f"{prefix}{other}: missing (its {what} {prefix}{ext} exists)")
        if ext == ".idx":
            prefixes.append(prefix)
    if not prefixes:
        raise DataFileError(f"{directory}: no .bin/.idx datasets found (--input)")
    return prefixes


def merge_datasets(prefixes: list[str], output_prefix: str) -> IndexedDataset:
    """Write the concatenation of ``prefixes`` to ``output_prefix``; returns the merged dataset."""
    first = IndexedDataset(prefixes[0])
    for prefix in prefixes[1:]:
        dtype = IndexedDataset(prefix).dtype
        if dtype != first.dtype:
            raise DataFileError(f"{index_file_path(prefix)}: token dtype {dtype} differs from {first.dtype} "
                                f"of {index_file_path(prefixes[0])}; only datasets of one dtype (one "
                                f"tokenizer) can be merged")
    with IndexedDatasetBuilder(output_prefix, first.dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
    return IndexedDataset(output_prefix)


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="directory holding the .bin/.idx pairs to merge")
    parser.add_argument("--output-prefix", required=True, type=output_prefix, help="writes PREFIX.bin and PREFIX.idx")
    args = parser.parse_args(argv)
    try:
        prefixes = find_datasets(args.input)
        out = os.path.abspath(args.output_prefix)
        if out in (os.path.abspath(p) for p in prefixes):
            raise DataFileError(f"{args.output_prefix}: the output would overwrite one of the inputs")
        with terminate_as_interrupt():  # kill / SIGTERM cleans up like Ctrl-C: no temporary files left
            merged = merge_datasets(prefixes, args.output_prefix)
    except KeyboardInterrupt as err:
        print("interrupted: no output written", file=sys.stderr)
        return interrupted_exit_code(err)
    except DataFileError as e:
        print(str(e), file=sys.stderr)
        return 2
    except OSError as e:  # the output cannot be written there (a file in its path, no permission, disk full)
        print(f"--output-prefix {args.output_prefix}: cannot write the merged dataset ({e})", file=sys.stderr)
        return 2
    print(f"Merged {len(prefixes)} datasets: {len(merged)} sequences, {merged.num_documents()} documents, "
          f"{merged.num_tokens} tokens -> {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
