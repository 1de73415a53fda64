import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tool(*argv):
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory):
    """The README's default data, made the README's way: sample corpus -> SentencePiece -> .bin/.idx."""
    d = tmp_path_factory.mktemp("sample")
    run_tool("tools/make_sample_corpus.py", "--output", str(d / "corpus.jsonl"))
    run_tool("tools/train_tokenizer.py", "--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "spm"),
             "--vocab-size", "512")
    run_tool("tools/preprocess_data.py", "--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "sample"),
             "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(d / "spm.model"), "--append-eod")
    return {
        "prefix": str(d / "sample_text_document"),
        "tokenizer": ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(d / "spm.model")],
        "dir": d,
    }
