"""Write the offline sample corpus: Python's own documentation as JSONL, one document per line.

Every Python ships ``pydoc_data.topics`` (the language reference and library topics, ~465 KB of
English text); with ``--docstrings`` (default on) the docstrings of the standard-library modules
listed below are added too.  Documents are paragraph groups of about ``--doc-chars`` characters,
in a fixed order, so the file is the same on every run of the same Python version.

    python tools/make_sample_corpus.py --output data/sample.jsonl

``--chat`` writes a small chat set instead, for supervised fine-tuning (docs/fine-tuning.md): one
conversation per documented standard-library function or class, the user asking what it does and
the assistant answering with the first paragraph of its docstring (``{"messages": [...]}`` lines).

    python tools/make_sample_corpus.py --chat --output data/chat.jsonl
"""

import argparse
import importlib
import inspect
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.errors import OneLineParser, run_tool  # noqa: E402
from megatron_lite.files import replaced_whole  # noqa: E402

# Pure-Python, always-present, import-safe modules whose docstrings are ordinary English prose.
STDLIB_MODULES = (
    "abc argparse ast asyncio base64 bisect calendar cmd codecs collections colorsys configparser "
    "contextlib copy csv dataclasses datetime decimal difflib dis email enum filecmp fnmatch "
    "fractions ftplib functools getopt gettext glob graphlib gzip hashlib heapq hmac html http "
    "imaplib inspect io ipaddress itertools json locale logging mailbox mimetypes numbers operator "
    "optparse os pathlib pickle pkgutil platform plistlib poplib pprint profile pstats queue quopri "
    "random re reprlib sched secrets selectors shelve shlex shutil smtplib socket socketserver "
    "statistics string struct subprocess tarfile tempfile textwrap threading timeit tokenize "
    "traceback types typing unittest urllib uuid warnings wave weakref xml zipfile zipimport"
).split()


def topic_texts():
    from pydoc_data import topics

    for name in sorted(topics.topics):
        yield topics.topics[name]


def docstring_texts():
    for name in STDLIB_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # a module missing from a trimmed Python build: skip it
            continue
        parts = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 80:
                    parts.append(f"{attr}\n\n{doc}")
        yield "\n\n".join(p for p in parts if p)


def chat_records(max_chars: int = 600):
    """One {"messages": [user question, assistant answer]} per documented stdlib function or class."""
    for name in STDLIB_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:
            continue
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            doc = inspect.getdoc(obj) if inspect.isclass(obj) or inspect.isfunction(obj) else None
            answer = (doc or "").split("\n\n")[0].strip()
            if 40 <= len(answer) <= max_chars:
                kind = "class" if inspect.isclass(obj) else "function"
                yield {"messages": [{"role": "user", "content": f"What does the {kind} {name}.{attr} do?"},
                                    {"role": "assistant", "content": answer}]}


def documents(texts, doc_chars: int):
    """Group each text's paragraphs into documents of about doc_chars characters."""
    for text in texts:
        group, size = [], 0
        for para in text.split("\n\n"):
            if not para.strip():
                continue
            group.append(para.rstrip())
            size += len(para)
            if size >= doc_chars:
                yield "\n\n".join(group)
                group, size = [], 0
        if group:
            yield "\n\n".join(group)


def make_sample_corpus(output: str, doc_chars: int = 2000, docstrings: bool = True) -> tuple[int, int]:
    """Write the corpus to ``output`` (atomically); returns (documents, bytes)."""
    texts = list(topic_texts())
    if docstrings:
        texts += list(docstring_texts())
    return _write_jsonl(output, ({"text": doc} for doc in documents(texts, doc_chars)))


def _write_jsonl(output: str, records) -> tuple[int, int]:
    """Write ``records`` to ``output`` as JSONL (atomically); returns (lines, bytes)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    n = 0
    with replaced_whole(output) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n, os.path.getsize(output)


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--doc-chars", type=int, default=2000, help="approximate characters per document")
    parser.add_argument("--no-docstrings", action="store_true", help="only pydoc_data.topics")
    parser.add_argument("--chat", action="store_true", help="write chat conversations for --sft instead")
    args = parser.parse_args(argv)
    if args.chat:
        n, size = _write_jsonl(args.output, chat_records())
        print(f"Wrote {n} conversations ({size / 2**20:.2f} MB) to {args.output} (Python {sys.version.split()[0]})")
        return 0
    n, size = make_sample_corpus(args.output, args.doc_chars, not args.no_docstrings)
    print(f"Wrote {n} documents ({size / 2**20:.2f} MB) to {args.output} (Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
