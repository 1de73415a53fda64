"""Smaller user-facing messages: WSD without its decay length, a non-UTF-8 tokenizer corpus, the
16-bit-on-CPU warning."""

import os

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.config import Config
from megatron_lite.training import startup
from tests.cli_errors import refused_line
from tests.tools import load_tool


def test_wsd_without_decay_iters_names_the_flag(capsys):
    with pytest.raises(SystemExit) as err:
        parse_args(["--mock-data", "--vocab-size", "64", "--lr-decay-style", "WSD"], world_size=1)
    assert err.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "needs --lr-wsd-decay-iters" in line and "None" not in line


def test_train_tokenizer_names_a_non_utf8_file(tmp_path, capsys):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 3)
    code = load_tool("train_tokenizer").main(["--input", str(path), "--output-prefix", str(tmp_path / "spm")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{path}: not UTF-8 text" in err, err


@pytest.mark.parametrize("flag, native, warned", [("bf16", False, True), ("bf16", True, False), ("fp16", False, True),
                                                  (None, False, False)])
def test_half_precision_on_an_emulating_cpu_warns(monkeypatch, flag, native, warned):
    monkeypatch.setattr(startup, "cpu_has_native", lambda dtype: native)
    config = Config()
    if flag:
        setattr(config.precision, flag, True)
    message = startup.half_precision_warning(config, torch.device("cpu"))
    assert (message is not None) == warned
    if warned:
        assert f"--{flag}" in message and "slower than fp32" in message
    assert startup.half_precision_warning(config, torch.device("cuda")) is None


def test_negative_exit_interval_is_refused(capsys):
    """``iteration % -2 == 0`` at iteration 2: a negative --exit-interval used to stop the run there
    (and save) instead of being refused; 0 stays Megatron's "no exit"."""
    with pytest.raises(SystemExit) as err:
        parse_args(["--mock-data", "--vocab-size", "64", "--exit-interval", "-2"], world_size=1)
    assert err.value.code == 2
    assert "--exit-interval must not be negative, got -2" in capsys.readouterr().err
    assert parse_args(["--mock-data", "--vocab-size", "64", "--exit-interval", "0"], world_size=1).training.exit_interval == 0


@pytest.mark.parametrize("argv, error", [
    (["--mock-data"], "--mock-data needs --vocab-size (or --tokenizer-type"),
    (["--tokenizer-type", "NullTokenizer", "--data-path", "d"], "--tokenizer-type NullTokenizer needs --vocab-size"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"], "give --data-path (or --mock-data"),
    (["--mock-data", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m"], None),
    (["--mock-data", "--vocab-size", "64"], None),
])
def test_what_mock_data_and_null_tokenizer_need(capsys, argv, error):
    """--mock-data with a tokenizer's files was refused without --vocab-size, which it then ignored (the
    tokens come from the tokenizer's vocabulary, as in Megatron-LM); NullTokenizer without --data-path
    passed the checks and failed only after the model was built."""
    if error is None:
        parse_args(argv, world_size=1)
        return
    with pytest.raises(SystemExit) as err:
        parse_args(argv, world_size=1)
    assert err.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--min-frequency", "5"], ["--min-frequency is for --model-type byte-level-bpe or wordpiece", "bpe"]),
    (["--model-type", "unigram", "--min-frequency", "2"], ["--min-frequency", "unigram"]),
    (["--model-type", "byte-level-bpe", "--min-frequency", "0"], ["--min-frequency 0 must be at least 1"]),
    (["--model-type", "wordpiece", "--min-frequency", "-1"], ["--min-frequency -1 must be at least 1"]),
    (["--model-type", "byte-level-bpe", "--cased"], ["--cased is for --model-type wordpiece"]),
    (["--cased"], ["--cased is for --model-type wordpiece"]),
])
def test_train_tokenizer_refuses_flags_its_model_type_ignores(tmp_path, capsys, argv, words):
    """--min-frequency with SentencePiece (bpe/unigram), --min-frequency below 1 and --cased outside
    wordpiece trained as if they were not given; now one line naming the flag, exit 2, nothing written."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 3)
    main = load_tool("train_tokenizer").main
    refused_line(capsys, lambda: main(["--input", str(corpus), "--output-prefix", str(tmp_path / "m"), *argv]),
                 *words)
    assert not list(tmp_path.glob("m*"))


@pytest.mark.parametrize("size", [0, -3])
def test_null_tokenizer_vocab_size_below_one_is_refused_by_name(size):
    """--tokenizer-type NullTokenizer --vocab-size 0 (or below) built a tokenizer of vocab_size 1 (or
    negative) that refused every text as 'a token id is outside [0, 0)'; now the flag is named."""
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.errors import ConfigError

    with pytest.raises(ConfigError, match=f"--vocab-size {size} must be at least 1"):
        build_tokenizer("NullTokenizer", vocab_size=size)


def test_a_vocab_size_the_tokenizer_overrides_is_refused(capsys):
    """--vocab-size beside a tokenizer with its own vocabulary (GPT-2's 50,257 here) was silently
    replaced by the tokenizer's size; now one line naming both flags, exit 2. NullTokenizer's, and one
    equal to the tokenizer's, still train."""
    import pretrain_gpt
    from tests.inference_helpers import GPT2_TOKENIZER

    files = ["--vocab-file", GPT2_TOKENIZER["vocab_file"], "--merge-file", GPT2_TOKENIZER["merge_file"]]
    argv = ["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
            "--tokenizer-type", "GPT2BPETokenizer", *files]
    refused_line(capsys, lambda: pretrain_gpt.main(argv + ["--vocab-size", "1000"]),
                 "--vocab-size 1000 with --tokenizer-type GPT2BPETokenizer", "50257 tokens", "drop --vocab-size")
    config = parse_args(argv + ["--vocab-size", "50257"], world_size=1)
    pretrain_gpt.set_vocab(config, pretrain_gpt.build_tokenizer_for(config))
    assert config.model.padded_vocab_size == 50304
    config = parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99"], world_size=1)
    pretrain_gpt.set_vocab(config, pretrain_gpt.build_tokenizer_for(config))
    assert config.model.vocab_size == 100


@pytest.mark.parametrize("paths", [["--data-path", "corpus"], ["--train-data-path", "corpus"]])
def test_a_scripts_own_provider_given_data_paths_needs_a_tokenizer(capsys, paths):
    """parse_args(data_from_script=True) skipped the tokenizer check for a --data-path too: a provider
    reading it (pretrain_gpt's, say) then took NullTokenizer's EOD (--vocab-size) for the data's,
    silently. The data flags now need --tokenizer-type as in pretrain_gpt.py; without them a
    --vocab-size is enough, and NullTokenizer is the explicit way to take the ids as stored."""
    own = ["--vocab-size", "64"]
    refused_line(capsys, lambda: parse_args(own + paths, world_size=1, data_from_script=True),
                 f"{paths[0]} needs --tokenizer-type", "own datasets provider", "NullTokenizer with --vocab-size")
    assert parse_args(own, world_size=1, data_from_script=True).data.data_path is None
    null = parse_args(own + paths + ["--tokenizer-type", "NullTokenizer"], world_size=1, data_from_script=True)
    assert null.data.tokenizer_type == "NullTokenizer"
    refused_line(capsys, lambda: parse_args(own + paths, world_size=1), f"{paths[0]} needs --tokenizer-type (and its "
                 "vocab/model files)")  # the training scripts' line, unchanged


@pytest.mark.parametrize("tool", ["preprocess_data", "preprocess_sft"])
@pytest.mark.parametrize("kind", ["MultimodalTokenizer", "NullMultimodalTokenizer"])
def test_the_data_tools_refuse_megatron_tokenizer_types_as_training_does(tmp_path, capsys, tool, kind):
    """--tokenizer-type MultimodalTokenizer (Megatron-LM choices we lack) got pretrain_gpt.py's line naming
    why and what to use, but the data tools gave argparse's bare 'invalid choice' list; now the same line."""
    from megatron_lite.megatron_flags import megatron_value_message

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a"}\n')
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", kind,
            "--tokenizer-model", str(tmp_path / "tok.model")]
    with pytest.raises(SystemExit) as stop:
        load_tool(tool).main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert megatron_value_message(["--tokenizer-type", kind]) in err[0] and "invalid choice" not in err[0]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
