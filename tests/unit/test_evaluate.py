"""tools/evaluate.py: perplexity over overlapping windows (each target scored once, with the context
Megatron's windows give it), the word-level adjustment, .bin/.idx and JSONL input, and LAMBADA
last-word accuracy (strict and not). References are computed here token by token with the model."""

import json
import math
import os

import numpy as np
import pytest
import torch

from megatron_lite.inference.evaluation import lambada_example, windows
from megatron_lite.inference.loading import load_model
from tests.inference_helpers import GPT2_TOKENIZER, VOCAB, prompts, save_model
from tests.tools import load_tool

SEQ, STRIDE = 24, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("evaluate") / "ckpt")
    save_model("gpt", root)
    return root


@pytest.mark.parametrize("num_tokens, seq, stride", [(100, 24, 8), (25, 24, 8), (10, 24, 8), (97, 24, 24),
                                                     (64, 16, 1), (2, 4, 4), (33, 24, 8)])
def test_windows_score_every_target_exactly_once(num_tokens, seq, stride):
    scored = []
    for start, first in windows(num_tokens, seq, stride):
        last = min(start + seq, num_tokens - 1)
        scored += list(range(start + first + 1, last + 1))
        assert first == 0 or first == seq - stride
    assert scored == list(range(1, num_tokens))


def _reference_nll(model, tokens, seq, stride):
    """Sum of NLL, each target t predicted from the context Megatron's window scoring it gives."""
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(tokens)):
            start = 0 if t <= seq else math.ceil((t - seq) / stride) * stride
            logits = model(torch.tensor([tokens[start:t]]))[0, -1, :VOCAB]
            total -= float(logits.log_softmax(-1)[tokens[t]])
    return total


def _evaluate(capsys, *argv):
    assert load_tool("evaluate").main(list(argv)) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def _field(line, name):
    return float(line.split(f"{name}: ")[1].split(" ")[0])


def test_perplexity_of_jsonl_and_bin_idx_match_a_token_by_token_reference(checkpoint, tmp_path, capsys):
    from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder

    docs = prompts(3, seed=4, lengths=(30, 17, 21))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in docs))
    with IndexedDatasetBuilder(str(tmp_path / "docs"), dtype=np.int32) as builder:
        for d in docs:
            builder.add_item(d + [VOCAB - 1])
            builder.end_document()
    stream = [t for d in docs for t in d + [VOCAB - 1]]
    model, _ = load_model(checkpoint)
    nll = _reference_nll(model, stream, SEQ, STRIDE)
    flags = ["--task", "WIKITEXT103", "--load", checkpoint, "--seq-length", str(SEQ), "--overlapping-eval", str(STRIDE),
             "--micro-batch-size", "3"]
    text_line = _evaluate(capsys, *flags, "--valid-data", str(data))
    loss = nll / (len(stream) - 1)
    assert _field(text_line, "avg loss") == pytest.approx(loss, rel=1e-4)
    assert _field(text_line, "ppl") == pytest.approx(math.exp(loss), rel=1e-4)
    words = sum(len(d) for d in docs)  # NullTokenizer: one word per id
    assert _field(text_line, "adjusted ppl") == pytest.approx(math.exp(nll / (words - 1)), rel=1e-4)
    bin_line = _evaluate(capsys, *flags, "--valid-data", str(tmp_path / "docs"))
    assert _field(bin_line, "avg loss") == _field(text_line, "avg loss")
    assert "adjusted ppl: n/a" in bin_line


def test_lambada_counts_examples_whose_last_word_is_the_greedy_prediction(checkpoint, tmp_path, capsys):
    model, _ = load_model(checkpoint)
    texts, expected = [], 0
    for i, context in enumerate(prompts(6, seed=9, lengths=(6, 11, 9))):
        with torch.no_grad():
            best = int(model(torch.tensor([context]))[0, -1, :VOCAB - 1].argmax())
        last = best if i % 2 == 0 else (best + 1) % (VOCAB - 1)  # every other one wrong
        expected += i % 2 == 0
        texts.append(" ".join(map(str, context + [last])))
    data = tmp_path / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for strict in ([], ["--strict-lambada"]):
        line = _evaluate(capsys, "--task", "LAMBADA", "--load", checkpoint, "--valid-data", str(data), *strict)
        assert line == (f"validation results on LAMBADA | number correct: {expected} | total examples: 6 | "
                        f"avg accuracy: {expected / 6:.4E}")


def test_strict_lambada_targets_the_whole_last_word():
    from megatron_lite.data.tokenizers import build_tokenizer

    tok = build_tokenizer(**GPT2_TOKENIZER)
    text = "They sat down and ate the watermelonade"
    tokens, n = lambada_example(tok, text, strict=True)
    assert tokens[-n:] == tok.tokenize(" watermelonade") and n > 1
    assert tokens[:-n] == tok.tokenize("They sat down and ate the")
    tokens, n = lambada_example(tok, text, strict=False)
    assert n == 1 and tokens == tok.tokenize(text)


def test_strict_lambada_needs_every_target_token_and_a_long_text_keeps_its_end():
    """docs/inference.md: with --strict-lambada an example counts only when every token of the last word
    is the top choice (the NullTokenizer's words are one token each, where that could not show); a text
    longer than the window is scored on its last --seq-length + 1 tokens, the target among them."""
    from types import SimpleNamespace

    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.evaluation import lambada_accuracy

    class TargetTokenWrong:  # every position the top choice but the one ``back`` tokens before the end
        def __init__(self, back):
            self.back, self.seen = back, []

        def score(self, batch):
            self.seen.extend(batch)
            return [SimpleNamespace(greedy=[i != len(t) - 1 - self.back for i in range(len(t) - 1)]) for t in batch]

    tok = build_tokenizer(**GPT2_TOKENIZER)
    text = "They sat down and ate the watermelonade"
    _, n = lambada_example(tok, text, strict=True)
    assert n > 1
    first_of_word_wrong = TargetTokenWrong(back=n)
    assert lambada_accuracy(first_of_word_wrong, tok, [text], seq_length=64, strict=True, progress=False) == (0, 1)
    assert lambada_accuracy(first_of_word_wrong, tok, [text], seq_length=64, progress=False) == (1, 1)  # last token
    assert lambada_accuracy(TargetTokenWrong(back=1), tok, [text], seq_length=64, progress=False) == (0, 1)
    long_text = "so " * 60 + text
    engine = TargetTokenWrong(back=1)
    lambada_accuracy(engine, tok, [long_text], seq_length=16, progress=False)
    assert engine.seen == [tok.tokenize(long_text)[-17:]]


def test_evaluate_refuses_bad_input_in_one_line(checkpoint, tmp_path, capsys):
    tool = load_tool("evaluate")
    assert tool.main(["--task", "WIKITEXT103", "--load", checkpoint, "--valid-data", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --valid-data") and err.count("\n") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "1 2"}\n')
    assert tool.main(["--task", "LAMBADA", "--load", checkpoint, "--valid-data", str(bad)]) == 2
    assert "line 1 is not a JSON object with a 'text' string" in capsys.readouterr().err
    assert tool.main(["--task", "WIKITEXT103", "--load", checkpoint, "--valid-data", str(bad),
                      "--overlapping-eval", "0", "--json-key", "txt"]) == 2
    assert "--overlapping-eval 0 must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("lines, flags, message", [
    ('{"text": "1 2 3 4"}\n{"text": ""}\n', ["--task", "LAMBADA", "--strict-lambada"], "a LAMBADA text is empty"),
    ('{"text": "1 2 3 4"}\n{"text": "  "}\n', ["--task", "LAMBADA", "--strict-lambada"], "a LAMBADA text is empty"),
    ('{"text": "1 2 3 4"}\n{"text": 7}\n', ["--task", "LAMBADA"], "line 2 is not a JSON object with a 'text' string"),
    ('{"text": ["1 2"]}\n', ["--task", "WIKITEXT103"], "line 1 is not a JSON object with a 'text' string"),
    ('{"text": "1 2 3 4"}\n', ["--task", "WIKITEXT103", "--micro-batch-size", "0"], "--micro-batch-size 0 must be"),
    ('{"text": "1 2 3 4"}\n', ["--task", "LAMBADA", "--micro-batch-size", "-1"], "--micro-batch-size -1 must be"),
])
def test_bad_texts_and_batch_sizes_are_one_line_errors(checkpoint, tmp_path, capsys, lines, flags, message):
    data = tmp_path / "data.jsonl"
    data.write_text(lines)
    assert load_tool("evaluate").main([*flags, "--load", checkpoint, "--valid-data", str(data)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_strict_lambada_target_has_no_bos_of_a_tokenizer_that_adds_one(tmp_path):
    """A Llama-style tokenizer.json adds a BOS before every text it encodes: the strict target (the
    last word, encoded on its own) carried that BOS in the middle of the example, a token the model
    must then predict, so no example could ever be correct."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from megatron_lite.data.tokenizers import build_tokenizer

    words = ["<unk>", "<s>", "</s>", "they", "ate", "the", "melon"]
    hf = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))
    tokens, n = lambada_example(tok, "they ate the melon", strict=True)
    assert (tokens, n) == ([1, 3, 4, 5, 6], 1)  # one BOS, at the start of the context
    assert lambada_example(tok, "they ate the melon", strict=False) == ([1, 3, 4, 5, 6], 1)


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "SentencePieceTokenizer"])
def test_strict_lambada_target_of_a_sentencepiece_tokenizer_has_no_extra_space(tmp_path, tokenizer_type):
    """A SentencePiece model (tools/train_tokenizer.py's default) prefixes every encoded text with its
    space piece, so " " + word came out "▁" "▁word": the example scored the model on a text with two
    spaces before the last word, a token it was never shown. The example is now the text's own tokens."""
    from megatron_lite.data.tokenizers import build_tokenizer

    with open(os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "tiny_corpus.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f]
    model = load_tool("train_tokenizer").train_sentencepiece(texts * 2, str(tmp_path / "sp"), 600)
    tok = build_tokenizer(tokenizer_type, tokenizer_model=model)
    for text in ["the model is a cat", "They sat down and ate the watermelonade", texts[0]]:
        tokens, n = lambada_example(tok, text, strict=True)
        word = text.split()[-1]
        assert tokens == tok.tokenize(text[:text.rfind(word)].strip() + " " + word), text
        assert tok.detokenize(tokens[-n:]).strip() == text.split()[-1]


def test_jsonl_word_count_skips_empty_documents_and_tokens_count_every_end_of_document(tmp_path):
    """T holds each document's tokens and its end-of-document token (scored, as Megatron scores its
    newline tokens); W only the words. An empty document counted one word (Megatron's
    ``len("".split(" ")) == 1``), lowering the adjusted ppl; now it adds its end-of-document token only."""
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.evaluation import read_token_stream, word_count

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["1 2 3", "", "   ", "4 5"]))
    tokens, words = read_token_stream(str(data), tokenizer)
    eod = tokenizer.eod
    assert tokens == [1, 2, 3, eod, eod, eod, 4, 5, eod] and words == 5
    assert word_count(" a b  c \n") == 4 and word_count("") == 0  # Megatron's single-space split otherwise


def test_ppl_and_adjusted_ppl_are_capped_at_exp_20():
    """docs/inference.md: ``ppl = exp(min(20, avg loss))`` and ``adjusted ppl = exp(min(20, sum(NLL) / (W - 1)))``
    (Megatron's cap), on a text whose every target costs 25 nats; below the cap they are the plain exponentials."""
    from types import SimpleNamespace

    from megatron_lite.inference.evaluation import perplexity

    class Engine:
        def __init__(self, nll):
            self.nll = nll

        def score(self, windows):
            return [SimpleNamespace(log_probs=[-self.nll] * (len(w) - 1)) for w in windows]

    high = perplexity(Engine(25.0), list(range(9)), seq_length=4, stride=2, num_words=5, progress=False)
    assert high.loss == pytest.approx(25.0) and high.ppl == pytest.approx(math.exp(20))
    assert high.adjusted_ppl == pytest.approx(math.exp(20))
    low = perplexity(Engine(2.0), list(range(9)), seq_length=4, stride=2, num_words=5, progress=False)
    assert low.ppl == pytest.approx(math.exp(2.0)) and low.adjusted_ppl == pytest.approx(math.exp(2.0 * 8 / 4))


def test_a_bert_checkpoint_is_refused_naming_evaluation(tmp_path, capsys):
    """tools/evaluate.py given a BERT checkpoint said "text generation needs a GPT checkpoint"
    (generate.py's words); it names evaluation. tools/generate.py keeps its own."""
    from megatron_lite.checkpoint import CheckpointError, save_checkpoint
    from megatron_lite.config import Config, ModelConfig
    from megatron_lite.models import BertModel, TransformerConfig
    from megatron_lite.parallel.state import ParallelState
    from pretrain_bert import BertConfig

    model = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=32,
                        max_position_embeddings=32, vocab_size=64, make_vocab_size_divisible_by=8)
    model.padded_vocab_size = 64
    run = Config(model=model, extra_sections=("bert",))
    run.bert, run.data.tokenizer_type, run.checkpoint.save = BertConfig(), "NullTokenizer", str(tmp_path / "bert")
    state = ParallelState()
    save_checkpoint(1, [BertModel(TransformerConfig.from_model(model), state)], None, None, 1, run, state)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "1 2 3 4"}\n')
    assert load_tool("evaluate").main(["--task", "WIKITEXT103", "--load", run.checkpoint.save,
                                       "--valid-data", str(data)]) == 2
    err = capsys.readouterr().err
    assert "holds a BERT checkpoint; evaluation needs a GPT checkpoint" in err and err.count("\n") == 1, err
    with pytest.raises(CheckpointError, match="holds a BERT checkpoint; text generation needs a GPT checkpoint"):
        load_model(run.checkpoint.save)


def test_the_token_ratio_is_printed_as_the_other_figures():
    """The JSONL line printed the ratio unformatted (``token ratio: 1.7026558891454966 |``); now in the
    other figures' format (4 decimals, exponent)."""
    from megatron_lite.inference.evaluation import Perplexity

    line = Perplexity(loss=2.0, ppl=math.exp(2.0), num_tokens=738, num_words=434).line()
    assert line.endswith("| adjusted ppl: 3.0089E+01 | token ratio: 1.7021E+00 |"), line
