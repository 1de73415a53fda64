"""Files written whole (megatron_lite/files.py): a writer that fails half-way leaves neither a
half-written target nor its temporary file, and the target as it was."""

import json
import os

import pytest
import torch

from megatron_lite.files import replaced_whole
from tests.tools import load_tool


class Unprintable:
    def __format__(self, spec):
        raise ValueError("cannot format")


def test_replaced_whole_replaces_on_success_and_removes_the_temporary_file_on_failure(tmp_path):
    target = tmp_path / "out.txt"
    with replaced_whole(str(target)) as tmp:
        (tmp_path / os.path.basename(tmp)).write_text("first")
    assert target.read_text() == "first"
    for error in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with replaced_whole(str(target)) as tmp:
                with open(tmp, "w") as f:
                    f.write("half")
                raise error
        assert os.listdir(tmp_path) == ["out.txt"] and target.read_text() == "first"


def _wordpiece(path):
    from megatron_lite.data.wordpiece import save_vocab

    save_vocab(["[PAD]", Unprintable()], path)


def _gpt2_bpe(path):
    from megatron_lite.data.gpt2_bpe import save_vocab_and_merges

    save_vocab_and_merges({"a": 0, "b": object()}, [], path, path + ".merges")  # json.dump fails mid-way


def _sample_corpus(path):
    def records():
        yield {"text": "one"}
        raise OSError(28, "No space left on device")

    load_tool("make_sample_corpus")._write_jsonl(path, records())


def _peft_adapter(path, monkeypatch=None):
    import safetensors.torch

    from megatron_lite.lora import peft_export

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(peft_export, "peft_adapter", lambda *a: ({}, {"w": torch.zeros(1)}))
    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    peft_export.save_peft_adapter({}, {}, "llama", os.path.dirname(os.path.dirname(path)))


@pytest.mark.parametrize("writer, name", [(_wordpiece, "vocab.txt"), (_gpt2_bpe, "vocab.json"),
                                          (_sample_corpus, "corpus.jsonl"),
                                          (_peft_adapter, "adapter/adapter_model.safetensors")])
def test_a_writer_failing_half_way_leaves_the_previous_file_and_no_temporary_one(tmp_path, monkeypatch, writer, name):
    """Each wrote a temporary file and renamed it, but a failure (an unprintable token, a value JSON
    cannot hold, a full disk) left ``<file>.tmp<pid>`` (now ``.tmp.<pid>``, as the checkpoint files) behind; now it is removed."""
    pytest.importorskip("safetensors")
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("previous")
    with pytest.raises((ValueError, TypeError, OSError)):
        if writer is _peft_adapter:
            writer(str(path), monkeypatch)
        else:
            writer(str(path))
    assert os.listdir(path.parent) == [path.name] and path.read_text() == "previous"


def test_make_sample_corpus_still_writes_its_jsonl(tmp_path):
    out = tmp_path / "c.jsonl"
    assert load_tool("make_sample_corpus")._write_jsonl(str(out), iter([{"text": "a"}, {"text": "b"}]))[0] == 2
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == ["a", "b"]
