"""What a data tool says when a path it reads is a folder or an unexpanded pattern, not the file (or
the ``.bin``/``.idx`` prefix) it takes: one line naming the path, what it is, and what to give instead.
Shared by tools/preprocess_data.py, tools/preprocess_sft.py and ``--data-path``; the callers raise the
line as their DataFileError (this module imports no dataset code). ``compressed_hint``: what to add when a
file fails to read as text because it is compressed other than as a .gz (preprocess_data, train_tokenizer)."""

from __future__ import annotations

import argparse
import glob
import os

SHOWN = 3  # prefixes listed when a folder of datasets is given


def not_an_input_file(path: str, flag: str = "--input", parquet: bool = True) -> str:
    """Why ``path`` (not a file) cannot be ``flag``, which takes one JSONL file (``parquet``: or a
    folder of .parquet files), and how to join shards instead."""
    one_file = (f"{flag} takes one JSONL file{' (or a folder of .parquet files)' if parquet else ''}: concatenate "
                "the shards (cat a.jsonl b.jsonl > all.jsonl) or preprocess each and join them with "
                "tools/merge_datasets.py")
    if os.path.isdir(path):
        return f"{path}: a folder{' without .parquet files' if parquet else ''}; {one_file}"
    matches = glob.glob(path) if glob.has_magic(path) else []
    if matches:
        return f"{path}: a pattern ({len(matches)} matches; patterns are not expanded); {one_file}"
    return f"{path}: input file not found ({flag})"


def prefixes_in(folder: str) -> list[str]:
    """The prefixes of the complete .bin/.idx pairs directly in ``folder``, sorted."""
    names = set(os.listdir(folder))
    return sorted(os.path.join(folder, n[:-4]) for n in names
                  if n.endswith(".idx") and not n.startswith(".") and n[:-4] + ".bin" in names)


PAIR = "the prefix of a .bin/.idx pair (PREFIX for PREFIX.bin and PREFIX.idx)"


def folder_not_prefix(folder: str, takes: str = PAIR) -> str:
    """``folder`` given where a dataset prefix is read (``--data-path``): it is a folder, the path
    ``takes`` is wanted, and the prefixes of the pairs inside (a few)."""
    found = prefixes_in(folder)
    more = f" (and {len(found) - SHOWN} more)" if len(found) > SHOWN else ""
    inside = f"the pairs inside: {' '.join(found[:SHOWN])}{more}" if found else "it holds no .bin/.idx pair"
    return f"{folder}: a folder, not {takes}; {inside}"


COMPRESSED = {b"\x1f\x8b": ("gzip", "gzip -dc"), b"BZh": ("bzip2", "bzip2 -dc"), b"\xfd7zXZ\x00": ("xz", "xz -dc"),
              b"\x28\xb5\x2f\xfd": ("zstd", "zstd -dc")}


def compressed_hint(path: str) -> str:
    """When a file does not read as text because it is compressed data other than a .gz (only .gz is
    decompressed): '; the file is X-compressed: ' and the fix; '' for any other file."""
    with open(path, "rb") as f:
        head = f.read(6)
    for magic, (what, command) in COMPRESSED.items():
        if head.startswith(magic):
            root, ext = os.path.splitext(path)
            out = root if ext in (".bz2", ".xz", ".zst") else f"{root}_plain{ext}"
            fix = ("rename it so its name ends in .gz (only .gz is decompressed)" if what == "gzip" else
                   f"only .gz is decompressed: decompress it ({command} {path} > {out}) or re-compress it with gzip")
            return f"; the file is {what}-compressed: {fix}"
    return ""


def output_prefix(value: str) -> str:
    """argparse type of the data tools' --output-prefix: a file-name prefix, not a folder ("out/" wrote
    out/_text_document.bin, or the hidden out/.bin)."""
    if not value or value.endswith(("/", os.sep)):
        folder = value.rstrip("/" + os.sep) or "."
        raise argparse.ArgumentTypeError(f"{value!r} is a folder; give a file-name prefix inside it, e.g. "
                                         f"{os.path.join(folder, 'corpus')}")
    return value


def file_not_prefix(path: str) -> str:
    """``path``, a file, given where the prefix of a .bin/.idx pair is read (``--data-path data/corpus.jsonl``):
    it is the text, not its tokens; the command that writes them and the prefix to give then."""
    base = path.removesuffix(".gz")
    root, ext = os.path.splitext(base)
    stem = root if ext in (".jsonl", ".json", ".parquet", ".txt") else base
    return (f"{path}: a file, not the prefix of a .bin/.idx pair (PREFIX for PREFIX.bin and PREFIX.idx); "
            f"tokenize text first: python tools/preprocess_data.py --input {path} --output-prefix {stem} "
            f"--tokenizer-type ... then --data-path {stem}_text_document (chat conversations: --sft reads JSONL)")
