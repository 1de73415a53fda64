"""--no-mmap-bin-files: the .bin is read with file reads (never memory-mapped) and gives the same
tokens and samples; --empty-unused-memory-level: torch.cuda.empty_cache at Megatron-LM's points on
a GPU, nothing on the CPU."""

import pickle

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron_lite import device
from megatron_lite.arguments import parse_args
from megatron_lite.data.builder import build_train_valid_test_datasets, dataset_config_from_args
from megatron_lite.data.indexed_dataset import IndexedDataset
from tests.unit.test_gpt_dataset import write_dataset

SIZES = [7, 3, 12, 5, 9, 1, 4, 8, 30, 2]


@pytest.fixture
def mapped(monkeypatch):
    """The paths np.memmap opens during the test."""
    paths, real = [], np.memmap

    def memmap(path, *args, **kwargs):
        paths.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(np, "memmap", memmap)
    return paths


def test_file_reads_give_the_mapped_tokens(tmp_path, mapped):
    write_dataset(tmp_path / "d", SIZES)
    mapped.clear()
    plain, reading = IndexedDataset(str(tmp_path / "d")), IndexedDataset(str(tmp_path / "d"), mmap_bin=False)
    assert [p.endswith(".bin") for p in mapped] == [False, True, False]  # the .idx both times, the .bin once
    for i in range(len(plain)):
        np.testing.assert_array_equal(reading[i], plain[i])
        np.testing.assert_array_equal(reading.get(i, 1, max(0, SIZES[i] - 2)), plain.get(i, 1, max(0, SIZES[i] - 2)))
    again = pickle.loads(pickle.dumps(reading))  # DataLoader workers under spawn reopen it the same way
    assert again.mmap_bin is False
    np.testing.assert_array_equal(again[8], plain[8])


def test_the_flag_reaches_the_datasets(tmp_path, mapped):
    write_dataset(tmp_path / "d", SIZES, eod=0)
    samples = {}
    for flag in ([], ["--no-mmap-bin-files"]):
        config = parse_args(["--data-path", str(tmp_path / "d"), "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "128", "--seq-length", "6",
                             "--split", "100,0,0", "--data-cache-path", str(tmp_path / "cache")] + flag)
        mapped.clear()
        train, _, _ = build_train_valid_test_datasets(dataset_config_from_args(config.flat()), [12, 0, 0])
        samples[bool(flag)] = [train[i]["tokens"].tolist() for i in range(12)]
        assert any(p.endswith(".bin") for p in mapped) == (not flag)
    assert samples[True] == samples[False]


TINY = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2",
        "--eval-interval", "2", "--eval-iters", "1"]


@pytest.mark.parametrize("level, calls", [("0", 0), ("1", 4), ("2", 6)])
def test_empty_cache_points(monkeypatch, level, calls):
    """Two steps, one validation and the test pass at the end: level 1 after each forward-backward (2
    training, 2 evaluation), level 2 also after each optimizer step. The device is made to read as CUDA for the check only."""
    seen = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append(1))
    monkeypatch.setattr(device, "get_device", lambda: torch.device("cuda"))  # what empty_unused_memory asks
    pretrain_gpt.main(TINY + ["--empty-unused-memory-level", level])
    assert len(seen) == calls


def test_empty_cache_is_a_no_op_on_the_cpu(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append(1))
    pretrain_gpt.main(TINY + ["--empty-unused-memory-level", "2"])
    assert seen == []


def test_levels_outside_0_to_2_exit_2(capsys):
    with pytest.raises(SystemExit) as err:
        parse_args(TINY + ["--empty-unused-memory-level", "3"])
    assert err.value.code == 2
    assert "--empty-unused-memory-level" in capsys.readouterr().err
