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


# The text-generation server's tests (tests/e2e/test_text_generation_server*.py): its chat template, prompts,
# checkpoint and one-process server.
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}7{% endif %}"
PROMPTS = ["5 17 42 8", "3 1 4 1 5 9 2 6 5"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT checkpoint (tests/inference_helpers.py's ``gpt``) for the text-generation server tests."""
    from tests.inference_helpers import save_model

    root = str(tmp_path_factory.mktemp("server") / "ckpt")
    save_model("gpt", root)
    return root


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """(base url, engine, tokenizer) of a one-process text-generation server in a thread over ``checkpoint``
    (tests/e2e/test_text_generation_server*.py), one per test module."""
    import threading

    from megatron_lite.inference.engine import InferenceEngine
    from megatron_lite.inference.loading import load_model, load_tokenizer
    from megatron_lite.inference.server import Runner, StopFlag, create_app, make_server, serve
    from tests.inference_helpers import MAX_LEN, VOCAB

    model, saved = load_model(checkpoint)
    tokenizer = load_tokenizer(saved)
    engine = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod)
    runner = Runner(engine)
    app = create_app(runner, tokenizer, chat_template=TEMPLATE)
    http = make_server(app, "127.0.0.1", 0)
    stop = StopFlag()
    thread = threading.Thread(target=serve, args=(http, runner, stop), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{http.server_port}", engine, tokenizer
    stop.request()
    thread.join(timeout=30)
