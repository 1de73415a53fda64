"""--train-data-path / --valid-data-path / --test-data-path: each split its own dataset or blend, every
document of it, instead of one --data-path blend cut by --split (Megatron-LM's per-split blends)."""

import numpy as np
import pytest

import pretrain_gpt
from megatron_lite.data.blended import BlendedDataset
from megatron_lite.data.builder import (
    DataConfigError,
    build_train_valid_test_datasets,
    dataset_config_from_args,
)
from megatron_lite.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDatasetBuilder
from tests.cli_errors import parse_refused
from tests.unit.test_data_builder import write


def _config(tmp_path, **paths):
    per_split = [paths.get(name) for name in ("train", "valid", "test")]
    return GPTDatasetConfig(seq_length=8, per_split_data_paths=per_split, data_cache_path=str(tmp_path / "c"))


def _samples(ds) -> np.ndarray:
    return np.stack([ds[i]["tokens"] for i in range(len(ds))])


def test_each_split_reads_every_document_of_its_own_dataset(tmp_path):
    """The train split of A is --data-path A --split 100,0,0's, the valid split of B is --data-path B
    --split 0,100,0's (the same documents, samples and order); no test path, no test split."""
    a, b = write(tmp_path / "a", 40, seed=1), write(tmp_path / "b", 30, seed=2)
    train, valid, test = build_train_valid_test_datasets(_config(tmp_path, train=[a], valid=[b]), [50, 12, 6])
    assert isinstance(train, GPTDataset) and train.document_ids.tolist() == list(range(40)) and test is None
    assert valid.document_ids.tolist() == list(range(30))
    whole_a = GPTDatasetConfig(seq_length=8, split="100,0,0", data_path=[a], data_cache_path=str(tmp_path / "d"))
    whole_b = GPTDatasetConfig(seq_length=8, split="0,100,0", data_path=[b], data_cache_path=str(tmp_path / "d"))
    np.testing.assert_array_equal(_samples(train), _samples(build_train_valid_test_datasets(whole_a, [50, 0, 0])[0]))
    np.testing.assert_array_equal(_samples(valid), _samples(build_train_valid_test_datasets(whole_b, [0, 12, 0])[1]))


def test_a_split_takes_a_weighted_blend(tmp_path):
    a, b, c = (write(tmp_path / n, 200, seed=s) for n, s in (("a", 1), ("b", 2), ("c", 3)))
    cfg = _config(tmp_path, train=["0.25", a, "0.75", b], test=[c])
    train, valid, test = build_train_valid_test_datasets(cfg, [1000, 0, 20])
    assert isinstance(train, BlendedDataset) and len(train) == 1000 and valid is None
    share = np.bincount(np.asarray(train.dataset_index), minlength=2) / 1000
    assert abs(share[0] - 0.25) < 0.01
    assert isinstance(test, GPTDataset) and test.document_ids.tolist() == list(range(200))


def test_errors_name_the_split_flag(tmp_path):
    a = write(tmp_path / "a", 20)
    with pytest.raises(DataFileError, match="^--valid-data-path: .*missing.idx"):
        build_train_valid_test_datasets(_config(tmp_path, train=[a], valid=[str(tmp_path / "missing")]), [4, 4, 0])
    with pytest.raises(DataConfigError, match="^--test-data-path '1 a b': expected 'w1 prefix1"):
        build_train_valid_test_datasets(_config(tmp_path, train=[a], test=["1", "a", "b"]), [4, 0, 4])
    empty = str(tmp_path / "empty")
    IndexedDatasetBuilder(empty, dtype=np.uint16).finalize()
    with pytest.raises(DataConfigError, match=f"^--valid-data-path {empty} has no documents"):
        build_train_valid_test_datasets(_config(tmp_path, train=[a], valid=[empty]), [4, 4, 0])
    with pytest.raises(DataConfigError, match="^training needs 4 train samples; give --train-data-path"):
        build_train_valid_test_datasets(_config(tmp_path, valid=[a]), [4, 4, 0])
    assert build_train_valid_test_datasets(_config(tmp_path, valid=[a]), [0, 4, 0])[1] is not None


def test_the_flags_reach_the_dataset_config():
    flat = {"seq_length": 8, "data_path": None, "train_data_path": ["1", "a", "2", "b"], "test_data_path": ["c"]}
    assert dataset_config_from_args(flat).per_split_data_paths == [["1", "a", "2", "b"], None, ["c"]]
    assert dataset_config_from_args(dict(flat, train_data_path=None, test_data_path=None,
                                         data_path=["a"])).per_split_data_paths is None
    assert dataset_config_from_args(flat, bert=True).per_split_data_paths == [["1", "a", "2", "b"], None, ["c"]]


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "500"]


@pytest.mark.parametrize("argv, words", [
    (["--data-path", "a", "--train-data-path", "b"], ["--data-path and --train-data-path", "not both"]),
    (["--valid-data-path", "b", "--test-data-path", "c"], ["--valid-data-path/--test-data-path need --train-data-path"]),
    (["--train-data-path", "b", "--sft"], ["--train-data-path: --sft reads its conversations from --data-path"]),
    (["--data-args-path", "blend.txt"], ["--data-args-path is a Megatron-LM flag", "--train-data-path"]),
    # --mock-data beside real data trained on random tokens, the data silently unread (Megatron-LM: one source only)
    (["--mock-data", "--data-path", "a"], ["--mock-data and --data-path are two data sources", "drop one"]),
    (["--mock-data", "--train-data-path", "a"], ["--mock-data and --train-data-path are two data sources"]),
    # --split with per-split paths was silently ignored (Megatron-LM refuses it: split and blend_per_split are incompatible)
    (["--train-data-path", "b", "--valid-data-path", "c", "--split", "90,10,0"],
     ["--split 90,10,0: --train-data-path/--valid-data-path give each split its own data", "drop --split"]),
])
def test_bad_combinations_are_refused_in_one_line(capsys, argv, words):
    parse_refused(capsys, BASE + argv, *words)


def test_a_missing_tokenizer_names_the_per_split_flag(capsys):
    without = [a for a in BASE if a not in ("--tokenizer-type", "NullTokenizer", "--vocab-size", "500")]
    parse_refused(capsys, without + ["--train-data-path", "b"], "--train-data-path needs --tokenizer-type")


def test_pretrain_gpt_trains_on_the_train_path_and_validates_on_the_valid_path(tmp_path):
    """The training losses are --data-path A --split 100,0,0's; the validation loss is the valid set's:
    B's differs from A's (the same model at the same step, other data)."""
    a, b = write(tmp_path / "a", 60, seed=1), write(tmp_path / "b", 60, seed=2)
    run = BASE + ["--lr", "1e-2", "--eval-interval", "4", "--eval-iters", "1", "--seed", "3", "--log-interval", "1",
                  "--data-cache-path", str(tmp_path / "c")]
    whole_a = pretrain_gpt.main(run + ["--data-path", a, "--split", "100,0,0"])
    on_b = pretrain_gpt.main(run + ["--train-data-path", a, "--valid-data-path", b])
    on_a = pretrain_gpt.main(run + ["--train-data-path", a, "--valid-data-path", a])
    no_valid = pretrain_gpt.main(run + ["--train-data-path", a])
    assert on_b.losses == whole_a.losses == on_a.losses == no_valid.losses and len(on_b.losses) == 4
    assert whole_a.validation == no_valid.validation == [] and len(on_b.validation) == len(on_a.validation) == 1
    assert on_b.validation[0][1] != on_a.validation[0][1]

