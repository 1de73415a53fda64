"""A folder given where a dataset prefix is read (``--data-path data/``), or where one JSONL file is
(``tools/preprocess_sft.py --input shards/`` or a quoted glob), said 'data.idx: file not found' /
'input file not found' though the path exists; now one line says it is a folder (or a pattern), what
the flag takes, and the prefixes of the .bin/.idx pairs inside (a few)."""

import json
import os

import numpy as np
import pytest

from megatron_lite.data.builder import _open
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDatasetBuilder
from megatron_lite.data.sft_conversations import read_conversations
from tests.sft_helpers import write_tokenizer
from tests.tools import load_tool


def _pair(prefix):
    with IndexedDatasetBuilder(str(prefix), dtype=np.uint16) as b:
        b.add_item(np.array([1, 2, 3], dtype=np.uint16))
        b.end_document()


def test_a_folder_as_data_path_says_so_and_lists_the_prefixes_inside(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(DataFileError) as err:
        _open(str(data))
    assert str(err.value) == (f"--data-path: {data}: a folder, not the prefix of a .bin/.idx pair (PREFIX for "
                              "PREFIX.bin and PREFIX.idx); it holds no .bin/.idx pair")
    for name in ("d_text_document", "a_text_document", "c_text_document", "b_text_document"):
        _pair(data / name)
    (data / "lone.idx").write_bytes(b"")  # half a pair: not listed
    with pytest.raises(DataFileError) as err:
        _open(str(data), flag="--valid-data-path")
    assert str(err.value).startswith(f"--valid-data-path: {data}: a folder, not the prefix"), err.value
    listed = " ".join(str(data / f"{c}_text_document") for c in "abc")
    assert str(err.value).endswith(f"the pairs inside: {listed} (and 1 more)"), err.value
    _open(str(data / "a_text_document"))  # the prefix itself opens


def test_a_folder_as_sft_data_path_says_so(tmp_path):
    with pytest.raises(DataFileError, match=f"^{tmp_path}: a folder, not a JSONL file nor the prefix of a .bin/.idx"):
        read_conversations(str(tmp_path), tokenizer=None)


@pytest.mark.parametrize("given", ["folder", "pattern"])
def test_preprocess_sft_input_a_folder_or_a_pattern_says_what_input_takes(tmp_path, capsys, given):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (shards / name).write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    path = shards if given == "folder" else shards / "*.jsonl"
    out = tmp_path / "out"
    code = load_tool("preprocess_sft").main(["--input", str(path), "--output-prefix", str(out), "--tokenizer-type",
                                             "HuggingFaceTokenizer", "--tokenizer-model",
                                             write_tokenizer(tmp_path / "tok"), "--no-progress"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    words = ["a folder;"] if given == "folder" else ["a pattern (2 matches; patterns are not expanded)"]
    for word in words + ["--input takes one JSONL file: concatenate the shards", "tools/merge_datasets.py"]:
        assert word in lines[0], lines[0]
    assert "parquet" not in lines[0]
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("tool", ["preprocess_data", "preprocess_sft", "merge_datasets", "train_tokenizer"])
def test_an_output_prefix_that_is_a_folder_is_refused(tmp_path, capsys, tool):
    """--output-prefix out/ (a folder, as a user naming where the files go writes it) was taken as a prefix:
    preprocess_data wrote out/_text_document.bin/.idx, preprocess_sft and merge_datasets the hidden
    out/.bin and out/.idx, train_tokenizer out/.model. Now one line naming the flag and a prefix inside the
    folder, exit 2, before anything is read or written."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "1 2"}\n')
    out = str(tmp_path / "out") + "/"
    with pytest.raises(SystemExit) as stop:
        load_tool(tool).main(["--input", str(src), "--output-prefix", out, "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", "10"][: 4 if tool in ("merge_datasets", "train_tokenizer") else None])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert f"--output-prefix: {out!r} is a folder" in err[0] and os.path.join(str(tmp_path / "out"), "corpus") in err[0]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.jsonl.gz", "corpus.parquet"])
def test_a_text_file_as_data_path_says_to_preprocess_it(tmp_path, name):
    """--data-path data/corpus.jsonl (the raw corpus, not its tokens) said 'data/corpus.jsonl.idx: file not
    found (expected a Megatron .bin/.idx pair ...)', which does not say the text must be preprocessed first;
    now the line says it is a file, not a prefix, and gives the tools/preprocess_data.py command and the
    prefix it writes (and --sft for conversations)."""
    path = tmp_path / name
    path.write_text('{"text": "1 2"}\n')
    with pytest.raises(DataFileError) as err:
        _open(str(path))
    stem = str(tmp_path / "corpus")
    assert f"{path}: a file, not the prefix of a .bin/.idx pair" in str(err.value)
    assert f"tools/preprocess_data.py --input {path} --output-prefix {stem}" in str(err.value)
    assert f"--data-path {stem}_text_document" in str(err.value) and "--sft" in str(err.value)
