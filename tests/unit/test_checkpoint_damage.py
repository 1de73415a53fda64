"""Damaged checkpoints are refused in one line naming the file (and tensor), never half-loaded:
foreign objects in a model file, bad tracker files, a --load folder with checkpoints but no
tracker, flipped bytes inside a tensor (per-tensor checksums), and saves that cannot be written."""

import os

import pytest
import torch

from megatron_lite.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_lite.checkpoint.format import read_tracker
from tests.unit.test_checkpointing import _setup, _train


def _saved(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 1)
    save_checkpoint(1, [model], opt, sched, 4, cfg, state)
    root = tmp_path / "ckpt"
    return cfg, state, model, opt, sched, root, root / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt"


def _refused(cfg, state, model, opt, sched, *words):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint([model], opt, sched, cfg, state)
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, message
    for k, v in model.state_dict().items():  # nothing was half-loaded
        assert torch.equal(v, before[k]), k
    return message


@pytest.mark.parametrize("obj, words", [
    ({"a": 1}, ["a dict without iteration"]),
    (torch.zeros(3), ["a Tensor"]),
    ([1, 2], ["a list"]),
    ("MODEL_AS_TENSOR", ["its 'model' is a Tensor"]),
])
def test_model_file_holding_something_else(tmp_path, obj, words):
    cfg, state, model, opt, sched, root, path = _saved(tmp_path)
    if obj == "MODEL_AS_TENSOR":
        payload = torch.load(path, weights_only=True)
        payload.pop("tensor_checksums")
        obj = dict(payload, model=torch.zeros(2))
    torch.save(obj, path)
    _refused(cfg, state, model, opt, sched, str(path), "not a megatron_lite checkpoint file", *words)


def test_rng_file_holding_something_else(tmp_path):
    cfg, state, model, opt, sched, root, _ = _saved(tmp_path)
    rng = root / "iter_0000001" / "rng" / "rank_00000.pt"
    torch.save({"python": 1, "numpy": 2, "torch_cpu": 3, "tracker": 4}, rng)
    with pytest.raises(CheckpointError, match="rank_00000.pt holds states of the wrong kind"):
        load_checkpoint([model], opt, sched, cfg, state)


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(b"\xff\xfe\x00\x81"), ["is unreadable (UnicodeDecodeError)"]),
    (lambda p: (p.unlink(), p.mkdir()), ["is not a file"]),
    (lambda p: p.write_text("twelve\n"), ["should hold an iteration number"]),
    (lambda p: p.write_text("-3\n"), ["should hold an iteration number (0 or more) but holds '-3'"]),
])
def test_bad_tracker_is_refused(tmp_path, damage, words):
    cfg, state, model, opt, sched, root, _ = _saved(tmp_path)
    damage(root / "latest_checkpointed_iteration.txt")
    _refused(cfg, state, model, opt, sched, "latest_checkpointed_iteration.txt", *words)


def test_checkpoints_without_tracker_are_not_silently_restarted_over(tmp_path):
    cfg, state, model, opt, sched, root, _ = _saved(tmp_path)
    (root / "latest_checkpointed_iteration.txt").unlink()
    _refused(cfg, state, model, opt, sched, f"--load {root} holds 1 checkpoint folder(s) (newest iter_0000001)")


def test_absent_or_empty_load_folder_starts_from_scratch(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    assert load_checkpoint([model], opt, sched, cfg, state) == (0, 0)  # absent
    os.makedirs(cfg.checkpoint.load)
    assert load_checkpoint([model], opt, sched, cfg, state) == (0, 0)  # empty
    # the leftover of a first save killed before any model file was complete is not a checkpoint
    os.makedirs(os.path.join(cfg.checkpoint.load, "iter_0000001", "rng"))
    open(os.path.join(cfg.checkpoint.load, "iter_0000001", "rng", "rank_00000.pt"), "wb").close()
    os.makedirs(os.path.join(cfg.checkpoint.load, "iter_0000001", "mp_rank_00_000"))
    assert load_checkpoint([model], opt, sched, cfg, state) == (0, 0)


def test_flipped_byte_inside_a_tensor_fails_its_checksum(tmp_path):
    cfg, state, model, opt, sched, root, path = _saved(tmp_path)
    weight = model.fc1.weight.detach()
    data = bytearray(path.read_bytes())
    at = data.find(weight.numpy().tobytes())
    assert at >= 0
    data[at + 3] ^= 0x40  # the exponent byte of the first float32 (little-endian)
    path.write_bytes(bytes(data))
    _refused(cfg, state, model, opt, sched, str(path), "tensor model/0/fc1.weight fails its checksum")


def test_tracker_that_is_a_folder_stops_the_save_in_one_line(tmp_path):
    cfg, state, model, opt, sched = _setup(tmp_path)
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    tracker.mkdir(parents=True)
    with pytest.raises(CheckpointError, match="could not save checkpoint iteration 3 to --save .*previous checkpoint"):
        save_checkpoint(3, [model], opt, sched, 4, cfg, state)
    assert not [f for f in os.listdir(tmp_path / "ckpt") if ".tmp." in f]
    with pytest.raises(CheckpointError):
        read_tracker(str(tmp_path / "ckpt"))


def test_load_pointing_inside_a_checkpoint_is_refused_not_a_fresh_start(tmp_path):
    """--load naming one iteration folder (or a model file) of a checkpoint instead of the save folder
    used to find no tracker there and train from scratch; it is refused, naming the folder to use."""
    cfg, state, model, opt, sched, root, path = _saved(tmp_path)
    cfg.checkpoint.load = str(root / "iter_0000001")
    _refused(cfg, state, model, opt, sched, f"--load {root / 'iter_0000001'} is one checkpoint's iteration folder",
             f"point --load at the folder above it, {root} ")
    cfg.checkpoint.load = str(path)
    _refused(cfg, state, model, opt, sched, f"--load {path} is a file")


@pytest.mark.parametrize("weights", ["model.safetensors", "model.safetensors.index.json"])
def test_load_pointing_at_a_hugging_face_folder_is_refused_not_a_fresh_start(tmp_path, weights):
    """A Hugging Face model folder given to --load held no tracker, so the run trained from scratch."""
    cfg, state, model, opt, sched = _setup(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / weights).write_bytes(b"weights")
    cfg.checkpoint.load = str(hf)
    _refused(cfg, state, model, opt, sched, f"--load {hf} is a Hugging Face model folder",
             "--loader hf --saver megatron")
