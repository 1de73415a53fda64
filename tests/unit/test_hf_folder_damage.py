"""A damaged Hugging Face folder given to ``tools/checkpoint/convert.py --loader hf`` is one line on
stderr naming the file, with exit code 2 (not a JSON / safetensors / KeyError traceback): invalid
config.json, a config without a field its model type needs, a truncated safetensors file, a shard the
index lists that is missing, an index without its weight map."""

import json

import pytest
import torch

from tests.tools import load_tool

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny Llama saved by transformers in shards (model-0000i-of-0000n + the index)."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(folder), max_shard_size="20KB")
    return folder


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _first_shard(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / sorted(set(index["weight_map"].values()))[0]


def _config(folder, change):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def _cut(folder, name, rows):
    """Keep the first ``rows`` rows of tensor ``name`` in the shard that holds it."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = str(folder / index["weight_map"][name])
    tensors = load_file(shard)
    tensors[name] = tensors[name][:rows].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})


DAMAGE = {
    "config.json not JSON": (lambda f: (f / "config.json").write_text("{not json"),
                             ["config.json is not readable JSON (JSONDecodeError"]),
    "config.json a list": (lambda f: (f / "config.json").write_text("[1, 2]"), ["config.json holds a JSON list"]),
    "config field missing": (lambda f: _config(f, lambda c: c.pop("hidden_size")),
                             ["config.json has no 'hidden_size'", "'llama'"]),
    "truncated shard": (lambda f: _first_shard(f).write_bytes(_first_shard(f).read_bytes()[:100]),
                        ["-of-", "is unreadable (SafetensorError", "truncated or corrupt"]),
    "missing shard": (lambda f: _first_shard(f).unlink(), ["-of-", "(listed in", "is missing"]),
    "a tensor of the wrong shape": (lambda f: _cut(f, "model.layers.1.self_attn.k_proj.weight", 6),
                                    ["a tensor of layer 1 (model.layers.1.*) does not have the shape config.json gives",
                                     "the folder does not match its config.json"]),
    "index without weight map": (lambda f: (f / "model.safetensors.index.json").write_text('{"metadata": {}}'),
                                 ["model.safetensors.index.json has no weight_map"]),
}


def test_the_intact_folder_converts(hf_folder, tmp_path):
    convert = load_tool("checkpoint/convert")
    assert convert.main(["--model-type", "GPT", "--loader", "hf", "--load-dir", str(hf_folder),
                         "--save-dir", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_hugging_face_folder_is_one_line_naming_the_file(hf_folder, tmp_path, capsys, damage):
    broken = _copy(hf_folder, tmp_path / "broken")
    change, words = DAMAGE[damage]
    change(broken)
    capsys.readouterr()
    convert = load_tool("checkpoint/convert")
    code = convert.main(["--model-type", "GPT", "--loader", "hf", "--load-dir", str(broken),
                         "--save-dir", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert str(broken) in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("leftover", ["model.safetensors", "model-00001-of-00009.safetensors", "config.json"])
def test_export_into_a_folder_holding_model_files_is_refused(hf_folder, tmp_path, capsys, leftover):
    """The leftover of an interrupted export (no config.json yet) used to stay beside the new files:
    transformers (and --loader hf) read a stale model.safetensors before the shards written now."""
    out = tmp_path / "out"
    out.mkdir()
    (out / leftover).write_bytes(b"stale")
    capsys.readouterr()
    convert = load_tool("checkpoint/convert")
    code = convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "hf", "--load-dir", str(hf_folder),
                         "--save-dir", str(out), "--max-shard-size", "20KB"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"{out} already holds {leftover}" in lines[0] and "choose an empty --save-dir" in lines[0], lines[0]
    assert sorted(p.name for p in out.iterdir()) == [leftover]  # nothing written beside it


@pytest.mark.parametrize("saver", ["megatron", "hf"])
@pytest.mark.parametrize("target", ["a file", "under a file"])
def test_a_save_dir_that_cannot_be_written_is_one_line(hf_folder, tmp_path, capsys, saver, target):
    """A --save-dir that is a file, or lies under one (as a read-only or full disk fails), was an
    OSError traceback; now one line naming --save-dir and the fix, exit 2."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    save = blocker if target == "a file" else blocker / "out"
    capsys.readouterr()
    convert = load_tool("checkpoint/convert")
    code = convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", saver, "--load-dir", str(hf_folder),
                         "--save-dir", str(save)])
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "pipeline stages" not in line]  # tqdm
    assert code == 2 and len(lines) == 1, lines
    assert f"could not write --save-dir {save}" in lines[0] and "new folder you can write to" in lines[0], lines[0]


def test_a_megatron_save_dir_holding_a_checkpoint_is_refused(hf_folder, tmp_path, capsys):
    """Converting into a folder holding another run's checkpoints moved its tracker to the converted
    iteration (3 -> release): a run resuming there went back silently. Now refused; nothing written."""
    convert = load_tool("checkpoint/convert")
    run = tmp_path / "run"
    argv = ["--model-type", "GPT", "--loader", "hf", "--load-dir", str(hf_folder), "--save-dir", str(run)]
    assert convert.main(argv) == 0
    (run / "release").rename(run / "iter_0000003")
    (run / "latest_checkpointed_iteration.txt").write_text("3\n")
    capsys.readouterr()
    assert convert.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: {run} already holds checkpoints (iter_0000003, latest_checkpointed_iteration.txt); "
                     "choose an empty --save-dir"], lines
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "3\n" and not (run / "release").exists()


@pytest.mark.parametrize("option", ["--target-tensor-parallel-size", "--target-pipeline-parallel-size",
                                    "--target-expert-parallel-size", "--make-vocab-size-divisible-by"])
def test_a_target_size_of_0_is_refused(hf_folder, tmp_path, capsys, option):
    """A target size 0 was taken as 'the source's size' (the conversion ran at TP 1), a vocabulary
    divisor 0 as the default 128 (training refuses 0); now refused."""
    capsys.readouterr()
    convert = load_tool("checkpoint/convert")
    code = convert.main(["--model-type", "GPT", "--loader", "hf", "--load-dir", str(hf_folder),
                         "--save-dir", str(tmp_path / "out"), option, "0"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"{option} must be at least 1" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_an_export_onto_a_full_disk_is_one_line(hf_folder, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own exception (a SafetensorError): it was a traceback."""
    import safetensors.torch

    def full_disk(*args, **kwargs):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    capsys.readouterr()
    out = tmp_path / "out"
    code = load_tool("checkpoint/convert").main(["--model-type", "GPT", "--loader", "hf", "--saver", "hf",
                                                 "--load-dir", str(hf_folder), "--save-dir", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"could not write --save-dir {out}: write failed (Error while serializing: I/O error: No space left" in lines[0]


@pytest.mark.parametrize("size", ["0", "0.1", "five GB"])
def test_a_max_shard_size_that_is_not_a_positive_size_is_one_line(hf_folder, tmp_path, capsys, size):
    """--max-shard-size 0 (or a fraction of a byte) wrote every tensor to a safetensors file of its own."""
    out = tmp_path / "out"
    code = load_tool("checkpoint/convert").main(["--model-type", "GPT", "--loader", "hf", "--saver", "hf", "--load-dir",
                                                 str(hf_folder), "--save-dir", str(out), "--max-shard-size", size])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"--max-shard-size {size!r} is not a positive size" in lines[0], lines
    assert not out.exists() or not any(out.iterdir())
