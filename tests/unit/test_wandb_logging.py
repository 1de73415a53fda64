"""--wandb-project: a real W&B run in offline mode (no network) receives exactly the scalars, steps
and values that TensorBoard receives; without the optional package the flag is refused."""

import glob
import importlib.util
import math
import struct

import pytest

import pretrain_gpt
from tests.harness import run_in_new_process

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--mock-data", "--vocab-size", "100", "--micro-batch-size", "2", "--train-iters", "4",
    "--log-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
]


def _wandb_records(path):
    """The protobuf records of a ``.wandb`` run file: a 7-byte header, then LevelDB's log format
    (32 KiB blocks; each chunk: crc32, length, type 1=full 2=first 3=middle 4=last)."""
    data, pos, block, pending = open(path, "rb").read(), 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            yield pending


def _wandb_scalars(run_dir):
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
    out = {}
    for data in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    out[(key, step)] = float(item.value_json)
    return out


def _tensorboard_scalars(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [path] = glob.glob(f"{tb_dir}/events.out.tfevents.*")
    acc = EventAccumulator(path)
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def test_wandb_offline_gets_the_tensorboard_scalars(tmp_path):
    """In a process of its own (W&B starts a service process of its own and keeps global state),
    forked with torch already imported (tests/harness.py)."""
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    argv = TINY + ["--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project", "megatron-lite-test",
                   "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wb")]
    code, _, stderr = run_in_new_process(pretrain_gpt.main, argv, env=env)
    assert code == 0, stderr[-3000:]
    tb, wb = _tensorboard_scalars(tmp_path / "tb"), _wandb_scalars(tmp_path / "wb")
    assert {("lm loss", 4), ("learning-rate", 1), ("lm loss validation", 2), ("iteration-time", 4)} <= set(tb)
    assert set(wb) == set(tb)
    for key, value in tb.items():  # TensorBoard stores float32
        assert math.isclose(wb[key], value, rel_tol=1e-6, abs_tol=1e-30), key


def test_wandb_project_without_the_package_is_refused(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--wandb-project", "p"])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--wandb-project needs the optional 'wandb' package" in lines[0]


@pytest.mark.parametrize("login", ["none", "netrc", "api_key", "offline"])
def test_wandb_project_without_a_login_is_refused_before_the_model_is_built(monkeypatch, capsys, tmp_path, login):
    """No WANDB_API_KEY, no key in the netrc file W&B reads, not offline: one line, exit 2, and
    nothing built (the model provider is never called). Any of the three lets the check pass."""
    pytest.importorskip("wandb")
    import megatron_lite.training.loop as loop
    from megatron_lite.training.writers import check_wandb_available

    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login me password secret\n")
    monkeypatch.setenv("NETRC", str(netrc))
    config = pretrain_gpt.parse_args(TINY + ["--wandb-project", "p"])
    if login == "none":
        built = []
        monkeypatch.setattr(loop, "setup", lambda *a: built.append("setup"))
        with pytest.raises(SystemExit) as err:
            pretrain_gpt.main(TINY + ["--wandb-project", "p"])
        assert err.value.code == 2 and not built
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "no W&B login" in lines[0] and "WANDB_MODE=offline" in lines[0]
        return
    if login == "netrc":
        netrc.write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    else:
        monkeypatch.setenv(*{"api_key": ("WANDB_API_KEY", "k" * 40), "offline": ("WANDB_MODE", "offline")}[login])
    check_wandb_available(config)


@pytest.mark.parametrize("where", ["--wandb-save-dir", "<save>/wandb"])
def test_a_file_where_wandb_keeps_its_files_is_refused_before_training(monkeypatch, capsys, tmp_path, where):
    """--wandb-save-dir naming a file (or a file 'wandb' in --save, the default folder): a FileExistsError
    traceback when the writer was built, after the model; now one line with the other output folders, exit 2."""
    pytest.importorskip("wandb")
    import megatron_lite.training.loop as loop

    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "wandb").write_text("")
    flags = (["--wandb-save-dir", str(tmp_path / "wandb")] if where == "--wandb-save-dir"
             else ["--save", str(tmp_path)])
    built = []
    monkeypatch.setattr(loop, "setup", lambda *a: built.append("setup"))
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--wandb-project", "p"] + flags)
    assert err.value.code == 2 and not built
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{tmp_path / 'wandb'} is a file, not a folder" in lines[0], lines
