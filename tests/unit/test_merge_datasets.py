"""tools/merge_datasets.py and a folder holding half of a pair: a .bin without its .idx (or the other
way round) is one line naming the missing file, exit 2, nothing written; it is never left out of the
merge silently (Megatron-LM's merge refuses it too)."""

import os

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder
from tests.tools import load_tool


def _shards(folder):
    for name, docs in (("a", [[1, 2, 3]]), ("b", [[4, 5], [6]])):
        with IndexedDatasetBuilder(str(folder / name), np.uint16) as b:
            for doc in docs:
                b.add_document(doc, [len(doc)])


@pytest.mark.parametrize("removed", ["b.idx", "b.bin"])
def test_half_a_pair_is_refused_naming_the_missing_file(tmp_path, capsys, removed):
    shards = tmp_path / "shards"
    _shards(shards)
    os.remove(shards / removed)
    merge = load_tool("merge_datasets")
    assert merge.main(["--input", str(shards), "--output-prefix", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{shards / removed}: missing"), err
    assert not os.path.exists(tmp_path / "m.bin") and not os.path.exists(tmp_path / "m.idx")


def test_whole_pairs_merge(tmp_path, capsys):
    shards = tmp_path / "shards"
    _shards(shards)
    (shards / "notes.txt").write_text("not a dataset")
    merge = load_tool("merge_datasets")
    assert merge.main(["--input", str(shards), "--output-prefix", str(tmp_path / "m")]) == 0
    assert "Merged 2 datasets: 3 sequences" in capsys.readouterr().out


def _add_modes(prefix, modes):
    """Append Megatron's optional multimodal modes (one int8 per sequence) to ``prefix``.idx."""
    with open(f"{prefix}.idx", "ab") as f:
        f.write(np.asarray(modes, dtype=np.int8).tobytes())


def test_multimodal_modes_are_carried_into_the_merged_index(tmp_path, capsys):
    """The optional int8 mode per sequence of a multimodal .idx was dropped by the merge (the output's
    index ended after the document indices); now the merged index holds every input's modes, in order."""
    from megatron_lite.data.indexed_dataset import IndexedDataset

    shards = tmp_path / "shards"
    _shards(shards)
    _add_modes(shards / "a", [1])
    _add_modes(shards / "b", [0, 2])
    assert IndexedDataset(str(shards / "b")).sequence_modes.tolist() == [0, 2]
    merge = load_tool("merge_datasets")
    assert merge.main(["--input", str(shards), "--output-prefix", str(tmp_path / "m")]) == 0
    merged = IndexedDataset(str(tmp_path / "m"))
    assert merged.sequence_modes is not None and merged.sequence_modes.tolist() == [1, 0, 2]
    assert [merged[i].tolist() for i in range(3)] == [[1, 2, 3], [4, 5], [6]]
    plain = tmp_path / "plain"
    _shards(plain)
    assert merge.main(["--input", str(plain), "--output-prefix", str(tmp_path / "p")]) == 0
    assert IndexedDataset(str(tmp_path / "p")).sequence_modes is None  # none in, none out
    capsys.readouterr()


@pytest.mark.parametrize("with_modes", ["a", "b"])
def test_inputs_with_and_without_modes_are_refused_in_one_line(tmp_path, capsys, with_modes):
    shards = tmp_path / "shards"
    _shards(shards)
    _add_modes(shards / with_modes, [3] * (1 if with_modes == "a" else 2))
    merge = load_tool("merge_datasets")
    assert merge.main(["--input", str(shards), "--output-prefix", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{shards / 'b'}.idx: has"), err
    assert "multimodal sequence modes" in err[0] and "merge only datasets of one kind" in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["shards"]  # nothing written, no temporary file
