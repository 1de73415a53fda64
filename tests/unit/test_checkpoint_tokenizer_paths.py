"""A checkpoint names its tokenizer files by absolute paths, so the tools find them from any folder.

docs/inference.md: the tokenizer comes from the config saved in the checkpoint, and its lm-eval example
runs from tests/fixtures/lm_eval with ``load=../../../checkpoints/gpt``. A run given ``--tokenizer-model
data/spm4k.model`` (the docs' and the quickstart's relative paths) saved that relative path, so every
tool started elsewhere stopped with ``data/spm4k.model: file not found (given as --tokenizer-model ...)``,
a flag the user never gave. Both formats now record the absolute path; an older checkpoint's relative
path is one line saying what it is relative to and how to name the file."""

import os
import shutil

import pytest

from megatron_lite.checkpoint import merge_checkpoint
from megatron_lite.data.indexed_dataset import DataFileError
from megatron_lite.errors import ConfigError
from megatron_lite.inference.loading import load_tokenizer
from tests.inference_helpers import save_model
from tests.preprocess_helpers import make_tok_files
from tests.tools import load_tool

MODEL_VOCAB = 640  # the tokenizer below has ~600 pieces


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return make_tok_files(tmp_path_factory)["GPTSentencePieceTokenizer"]["tokenizer_model"]


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_relative_tokenizer_path_is_saved_absolute_and_found_from_elsewhere(tmp_path, monkeypatch, capsys,
                                                                               sp_model, ckpt_format):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    os.makedirs(run / "data")
    os.makedirs(elsewhere)
    shutil.copy(sp_model, run / "data" / "spm.model")
    monkeypatch.chdir(run)
    save_model("gpt", "checkpoints/gpt", ckpt_format,
               tokenizer={"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": "data/spm.model"},
               vocab=MODEL_VOCAB)
    monkeypatch.chdir(elsewhere)
    load = os.path.relpath(run / "checkpoints" / "gpt")
    saved = merge_checkpoint(load)[1]
    assert saved["tokenizer_model"] == str(run / "data" / "spm.model")
    assert load_tokenizer(saved).vocab_size <= MODEL_VOCAB
    capsys.readouterr()
    assert load_tool("generate").main(["--load", load, "--prompt", "The for statement", "--max-new-tokens", "2",
                                       "--greedy"]) == 0
    assert capsys.readouterr().out.startswith("The for statement")


def test_an_older_checkpoints_relative_tokenizer_path_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    saved = {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": "data/spm.model",
             "padded_vocab_size": MODEL_VOCAB}
    with pytest.raises(ConfigError) as err:
        load_tokenizer(saved)
    message = str(err.value)
    assert message.startswith("data/spm.model: the tokenizer file the checkpoint names (its run's --tokenizer-model) "
                              f"is not found from {tmp_path}") and "pass --tokenizer-model PATH" in message
    assert "\n" not in message
    with pytest.raises(DataFileError, match="given as --tokenizer-model"):  # a file given here: as before
        load_tokenizer(saved, tokenizer_model="other/spm.model")


def test_an_export_of_an_older_checkpoint_says_which_tokenizer_file_it_cannot_find(tmp_path, monkeypatch):
    """The converter's hf saver said '... needs --tokenizer-model' for a relative path it could not find."""
    from megatron_lite.checkpoint.hf_tokenizer import export_tokenizer

    monkeypatch.chdir(tmp_path)
    config = {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": "data/spm.model"}
    special, note = export_tokenizer(config, {}, str(tmp_path))
    assert special == {} and note.startswith("tokenizer: GPTSentencePieceTokenizer not written (data/spm.model, the "
                                             f"file the checkpoint names, is not found from {tmp_path}")
