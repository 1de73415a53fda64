"""Megatron-LM's TikTokenizer and Llama2Tokenizer end to end: tools/preprocess_data.py, a few steps of
pretrain_gpt.py on its output with a checkpoint, then tools/generate.py from that checkpoint alone (the
tokenizer flags it recorded), a non-ASCII prompt coming back as it was given."""

import pytest

import pretrain_gpt
from megatron_lite.checkpoint.format import checkpoint_config
from megatron_lite.inference.loading import load_tokenizer
from tests.preprocess_helpers import CORPUS, make_tok_files, texts, write_tiktoken_vocab
from tests.tools import load_tool

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
         "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0", "--split", "100,0,0",
         "--make-vocab-size-divisible-by", "8", "--seed", "3"]
PROMPT = "the café 日本 🙂"


@pytest.mark.parametrize("kind", ["TikTokenizer", "Llama2Tokenizer"])
def test_preprocess_train_and_generate(tmp_path_factory, tmp_path, capsys, kind):
    if kind == "TikTokenizer":
        size = 8 + write_tiktoken_vocab(tmp_path / "vocab.json", ("日本", " café"), texts())
        flags = ["--tokenizer-model", str(tmp_path / "vocab.json"), "--tiktoken-pattern", "v2",
                 "--tiktoken-num-special-tokens", "8", "--vocab-size", str(size)]
    else:
        flags = ["--tokenizer-model", make_tok_files(tmp_path_factory)["GPTSentencePieceTokenizer"]["tokenizer_model"]]
    flags = ["--tokenizer-type", kind, *flags]
    prefix = str(tmp_path / "data")
    assert load_tool("preprocess_data").main(["--input", CORPUS, "--output-prefix", prefix, "--append-eod",
                                              "--no-progress", *flags]) == 0
    save = str(tmp_path / "ckpt")
    result = pretrain_gpt.main([*MODEL, *flags, "--data-path", prefix + "_text_document", "--save", save])
    assert len(result.losses) == 3 and all(loss == loss for loss in result.losses)
    saved = checkpoint_config(save)
    tokenizer = load_tokenizer(saved, save)  # from the checkpoint's record alone
    assert type(tokenizer).__name__ == kind and tokenizer.tokenize(PROMPT) == pretrain_gpt.build_tokenizer(
        kind, **{k.lstrip("-").replace("-", "_"): v for k, v in zip(flags[2::2], flags[3::2])}).tokenize(PROMPT)
    capsys.readouterr()
    assert load_tool("generate").main(["--load", save, "--prompt", PROMPT, "--max-new-tokens", "4", "--greedy"]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)
    _served(save, tokenizer)


def _served(save, tokenizer):
    """The text-generation server on the checkpoint: PUT /api's text and an OpenAI completion's echo
    give the prompt back, its tokens the tokenizer's."""
    import threading

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("flask")
    from megatron_lite.inference.engine import InferenceEngine
    from megatron_lite.inference.loading import load_model
    from megatron_lite.inference.server import Runner, StopFlag, create_app, make_server, serve

    model, saved = load_model(save)
    engine = InferenceEngine(model, vocab_size=saved["vocab_size"], max_sequence_length=32, eod=tokenizer.eod)
    runner = Runner(engine)
    http, stop = make_server(create_app(runner, tokenizer), "127.0.0.1", 0), StopFlag()
    thread = threading.Thread(target=serve, args=(http, runner, stop), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{http.server_port}"
        r = httpx.put(f"{url}/api", json={"prompts": [PROMPT], "tokens_to_generate": 3, "top_k": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["text"][0].startswith(PROMPT), r.text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "echo": True,
                                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(PROMPT), r.text
    finally:
        stop.request()
        thread.join(timeout=30)
