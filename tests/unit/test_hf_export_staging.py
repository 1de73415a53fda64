"""A Hugging Face export (``tools/checkpoint/convert.py --saver hf``, with a LoRA checkpoint's PEFT
adapter) is written under ``<save-dir>.tmp.<pid>`` and moved into place once complete: an export that
fails half-way (a full disk) or is interrupted (Ctrl-C: exit 130; SIGTERM, which the tool turns into
an interrupt: 143) leaves neither --save-dir nor the temporary folder behind, and a rerun into the
same --save-dir succeeds."""

import errno
import os

import pytest

from megatron_lite.checkpoint import hf_io
from megatron_lite.data.interrupt import Terminated
from megatron_lite.files import replaced_folder
from tests.convert_helpers import convert
from tests.inference_helpers import save_model
from tests.tools import load_tool

pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("src") / "mega"
    save_model("gpt", str(root))
    return root


def _fail_after_the_first_file(monkeypatch, error):
    save, written = hf_io._save_file, []

    def failing(st, tensors, path):
        if written:
            raise error(path)
        written.append(path)
        save(st, tensors, path)

    monkeypatch.setattr(hf_io, "_save_file", failing)
    return save


@pytest.mark.parametrize("error", [lambda p: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), p),
                                   lambda p: KeyboardInterrupt(), lambda p: Terminated()],
                         ids=["disk full", "ctrl-c", "sigterm"])
@pytest.mark.parametrize("exists", [False, True], ids=["new", "empty"])
def test_an_export_failing_half_way_leaves_nothing_and_a_rerun_succeeds(source, tmp_path, monkeypatch, capsys,
                                                                        error, exists):
    """The second shard failing used to leave --save-dir holding the first one, and a rerun was refused
    ('already holds ... the leftover of an interrupted export') until the folder was deleted by hand."""
    out = tmp_path / "hf"
    if exists:
        out.mkdir()
    argv = ["--saver", "hf", "--load-dir", source, "--save-dir", out, "--max-shard-size", "2KB"]
    save = _fail_after_the_first_file(monkeypatch, error)
    if isinstance(error(""), KeyboardInterrupt):
        assert convert("GPT", *argv) == (143 if isinstance(error(""), Terminated) else 130)
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line == f"interrupted: nothing half-written is left in --save-dir {out}", line
    else:
        assert convert("GPT", *argv) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert f"could not write --save-dir {out}" in line and "No space left on device" in line, line
    assert sorted(os.listdir(tmp_path)) == (["hf"] if exists else [])  # no temporary folder either
    assert not exists or os.listdir(out) == []
    monkeypatch.setattr(hf_io, "_save_file", save)
    assert convert("GPT", *argv) == 0
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    names = os.listdir(out)
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert sum(n.endswith(".safetensors") for n in names) > 1


def test_replaced_folder_removes_a_killed_writers_folder_and_keeps_files_already_there(tmp_path, monkeypatch):
    """An existing --save-dir (empty, or holding files that are not a model's) is written into, its
    files kept; the staging folder is made inside it, so a mount point (another disk than its parent)
    never needs a rename across disks. config.json (``last``) is moved in after the weights: a reader
    that finds it finds the whole model."""
    replace, moved = os.replace, []
    monkeypatch.setattr(os, "replace", lambda src, dst: (moved.append(os.path.basename(dst)), replace(src, dst)))
    target, ended = tmp_path / "out", 2**22 + 12345  # no such process
    (tmp_path / f"out.tmp.{ended}").mkdir()
    (tmp_path / f"out.tmp.{ended}" / "model.safetensors").write_bytes(b"stale")
    target.mkdir()
    (target / f".staged.tmp.{ended}").mkdir()  # the same, inside an existing target
    (target / "README.md").write_text("mine")
    (target / "adapter").mkdir()
    (target / "adapter" / "notes.txt").write_text("mine")
    with replaced_folder(str(target), last=("config.json",)) as tmp:
        assert os.path.dirname(tmp) == str(target)  # an existing target may be a mount point: staged inside it
        for name in ("config.json", "a.safetensors"):
            (tmp_path / tmp / name).write_text(name)
        os.mkdir(os.path.join(tmp, "adapter"))
        (tmp_path / tmp / "adapter" / "adapter_config.json").write_text("{}")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert sorted(os.listdir(target)) == ["README.md", "a.safetensors", "adapter", "config.json"]
    assert sorted(os.listdir(target / "adapter")) == ["adapter_config.json", "notes.txt"]
    assert moved == ["a.safetensors", "adapter_config.json", "config.json"]


@pytest.mark.parametrize("shard_size", ["2KB", "5GB"], ids=["shards", "one file"])
def test_the_export_reports_each_safetensors_file_written(source, tmp_path, monkeypatch, shard_size):
    """save_hf took a ``progress`` argument it never used: the tool's progress (a bar on a terminal,
    plain lines in a log) showed the pipeline stages of a Megatron save but nothing of an HF export."""
    from megatron_lite.progress import progress

    tool, reported = load_tool("checkpoint/convert"), []

    def recording(iterable, **kw):
        for item in progress(iterable, enabled=False, **kw):
            reported.append((kw.get("desc"), item[0]))
            yield item

    monkeypatch.setattr(tool, "progress", recording)
    out = tmp_path / "hf"
    assert tool.main(["--model-type", "GPT", "--saver", "hf", "--load-dir", str(source), "--save-dir", str(out),
                      "--max-shard-size", shard_size]) == 0
    written = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert sorted(name for desc, name in reported if desc == "safetensors files") == written
    assert len(written) > 1 if shard_size == "2KB" else written == ["model.safetensors"]
