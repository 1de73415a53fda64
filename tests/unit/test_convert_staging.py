"""tools/checkpoint/convert.py --saver megatron writes ``iter_N`` under a temporary name and renames it
once every model file is complete: a failure (a full disk) leaves nothing half-written in --save-dir,
and the temporary folder of a conversion killed earlier does not get in the way. A ``.old_iter_N`` (a
checkpoint a training save set aside) is a checkpoint like the others: refused."""

import errno
import os
import subprocess

import pytest

from megatron_lite.checkpoint import load_gpt_checkpoint, merge_checkpoint, reshard
from tests.convert_helpers import convert
from tests.inference_helpers import save_model

TP2 = ["--target-tensor-parallel-size", "2"]


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.strip().splitlines() if "pipeline stages" not in line]  # tqdm


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("src") / "mega"
    save_model("gpt", str(root))
    return root


def test_a_conversion_failing_half_way_leaves_nothing_half_written(source, tmp_path, monkeypatch, capsys):
    """The second model file failing (disk full) used to leave iter_0000001 holding the first one: a
    folder that the listing takes for a checkpoint, and that a new conversion there refuses."""
    save, written = reshard.atomic_save, []

    def full_at_the_second(obj, path):
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        written.append(path)
        save(obj, path)

    out = tmp_path / "out"
    monkeypatch.setattr(reshard, "atomic_save", full_at_the_second)
    assert convert("GPT", "--load-dir", source, "--save-dir", out, *TP2) == 2
    [line] = _lines(capsys)
    assert f"could not write --save-dir {out}" in line and "No space left on device" in line, line
    assert not out.exists()  # nor the --save-dir the conversion created (as a failed Hugging Face export)
    monkeypatch.setattr(reshard, "atomic_save", save)
    assert convert("GPT", "--load-dir", source, "--save-dir", out, *TP2) == 0  # the same folder, again


def test_leftover_temporary_folders_do_not_confuse_the_conversion_or_a_later_load(source, tmp_path):
    """... and the tracker's temporary file of a conversion killed before its rename is removed (it
    stayed for good), not one a live process may be writing."""
    out = tmp_path / "out"
    for name in (".tmp_iter_0000001", ".tmp_iter_0000009"):  # conversions / saves killed half-way
        (out / name / "mp_rank_07_000").mkdir(parents=True)
        (out / name / "mp_rank_07_000" / "model_optim_rng.pt").write_bytes(b"stale")
    live = f"latest_checkpointed_iteration.txt.tmp.{os.getppid()}"
    ended = subprocess.Popen(["true"])
    ended.wait()
    for pid in (ended.pid, os.getppid()):  # a writer gone (as if killed) and a live process
        (out / f"latest_checkpointed_iteration.txt.tmp.{pid}").write_text("1\n")
    assert convert("GPT", "--load-dir", source, "--save-dir", out, *TP2) == 0
    assert sorted(os.listdir(out)) == [".tmp_iter_0000009", "iter_0000001", "latest_checkpointed_iteration.txt", live]
    assert sorted(os.listdir(out / "iter_0000001")) == ["mp_rank_00_000", "mp_rank_01_000"]
    assert load_gpt_checkpoint(str(out))[1]["tensor_model_parallel_size"] == 2
    merged = merge_checkpoint(str(out))[0]
    want = merge_checkpoint(str(source))[0]
    assert set(merged) == set(want)


def test_a_save_dir_holding_a_set_aside_checkpoint_is_refused(source, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert("GPT", "--load-dir", source, "--save-dir", tmp_path / "first") == 0
    out.mkdir()
    os.rename(tmp_path / "first" / "iter_0000001", out / ".old_iter_0000004")
    capsys.readouterr()
    assert convert("GPT", "--load-dir", source, "--save-dir", out) == 2
    assert _lines(capsys) == [
        f"error: {out} already holds checkpoints (.old_iter_0000004); choose an empty --save-dir"]
    assert sorted(os.listdir(out)) == [".old_iter_0000004"]


def test_a_tokenizer_copy_failing_leaves_no_checkpoint(tmp_path, monkeypatch, capsys):
    """The tokenizer files were copied after the tracker was written: a copy failing (disk full) left
    a checkpoint that looked complete but lacked (part of) its tokenizer/ folder. They are staged
    with the model files now, so the conversion leaves nothing, and a retry writes them all."""
    from megatron_lite.checkpoint import convert as plugins

    source = tmp_path / "src"
    save_model("gpt", str(source))
    (source / "tokenizer").mkdir()
    for name in ("vocab.json", "merges.txt"):
        (source / "tokenizer" / name).write_text(name)
    real = plugins.copy_tokenizer_files

    def full_after_the_first(files, folder):
        real(dict(list(files.items())[:1]), folder)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(folder, list(files)[1]))

    out = tmp_path / "out"
    monkeypatch.setattr(plugins, "copy_tokenizer_files", full_after_the_first)
    assert convert("GPT", "--load-dir", source, "--save-dir", out, *TP2) == 2
    [line] = _lines(capsys)
    assert f"could not write --save-dir {out}" in line and "No space left on device" in line, line
    assert not out.exists()
    monkeypatch.setattr(plugins, "copy_tokenizer_files", real)
    assert convert("GPT", "--load-dir", source, "--save-dir", out, *TP2) == 0
    assert sorted(os.listdir(out)) == ["iter_0000001", "latest_checkpointed_iteration.txt", "tokenizer"]
    assert sorted(os.listdir(out / "tokenizer")) == ["merges.txt", "vocab.json"]
    assert sorted(os.listdir(out / "iter_0000001")) == ["mp_rank_00_000", "mp_rank_01_000"]
