"""A refused command line names each flag as the user typed it, with its dashes: these lines used to
say 'num-query-groups 2 is not divisible by tensor-model-parallel-size 4' (no '--'), which reads as
prose and cannot be searched for in the command or in docs/flags.md."""

import re

import pytest

from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1"]

CASES = [  # (extra flags, world size, the flags the line must name with their dashes)
    (["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups", "2"], 4,
     ["--num-query-groups 2", "--tensor-model-parallel-size 4"]),
    (["--num-attention-heads", "3"], 1, ["--hidden-size 32", "--num-attention-heads 3"]),
    (["--group-query-attention", "--num-query-groups", "3"], 1, ["--num-attention-heads 4", "--num-query-groups 3"]),
    (["--pipeline-model-parallel-size", "3"], 3, ["--num-layers 4", "--pipeline-model-parallel-size 3"]),
    (["--global-batch-size", "3"], 2, ["--global-batch-size 3", "--micro-batch-size 1"]),
    (["--tensor-model-parallel-size", "4"], 6, ["--tensor-model-parallel-size 4", "--pipeline-model-parallel-size 1",
                                                "--context-parallel-size 1"]),
    (["--context-parallel-size", "4", "--seq-length", "12"], 4, ["--context-parallel-size 4", "--seq-length 12"]),
    (["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "8"], 1,
     ["--max-position-embeddings 8", "--seq-length 16"]),
]


@pytest.mark.parametrize("flags, world, words", CASES, ids=[" ".join(c[0][:2]) for c in CASES])
def test_refusal_names_the_flags_with_dashes(capsys, flags, world, words):
    line = parse_refused(capsys, BASE + flags, *words, world_size=world)
    for word in words:  # and never the bare spelling elsewhere on the line
        bare = word.split()[0][2:]
        assert not re.search(rf"(?<![-\w]){re.escape(bare)}\b", line), line
