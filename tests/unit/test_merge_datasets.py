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
