"""layer_ranges: even, explicit first/last and interleaved splits, and the errors naming the flags."""

import pytest

from megatron_lite.parallel.pipeline import layer_ranges, num_chunks


def test_even_split():
    assert layer_ranges(8, 4) == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    assert layer_ranges(3, 1) == [[(0, 3)]]


def test_first_and_last_stage_counts():
    assert layer_ranges(10, 4, first=1, last=3) == [[(0, 1)], [(1, 4)], [(4, 7)], [(7, 10)]]
    assert layer_ranges(7, 3, first=1) == [[(0, 1)], [(1, 4)], [(4, 7)]]
    assert layer_ranges(7, 3, last=3) == [[(0, 2)], [(2, 4)], [(4, 7)]]
    assert layer_ranges(5, 2, first=2, last=3) == [[(0, 2)], [(2, 5)]]
    assert layer_ranges(4, 2, first=0) == [[(0, 0)], [(0, 4)]]  # an embedding-only first stage
    assert layer_ranges(4, 3, first=0, last=0) == [[(0, 0)], [(0, 4)], [(4, 4)]]  # first and last may be empty


def test_interleaved_assignment():
    # chunk c of rank r holds virtual stage c * p + r
    assert layer_ranges(8, 2, vpp_layers=2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    ranges = layer_ranges(16, 4, vpp_layers=1)
    assert ranges[1] == [(1, 2), (5, 6), (9, 10), (13, 14)]
    # walking the virtual stages in order visits every layer once, consecutively
    p, v = 4, 4
    flat = [ranges[s % p][s // p] for s in range(p * v)]
    assert [a for a, _ in flat] == list(range(16)) and all(b == a + 1 for a, b in flat)
    assert num_chunks(16, 4, 1) == 4 and num_chunks(16, 4) == 1


@pytest.mark.parametrize("kwargs, flags", [
    (dict(num_layers=10, pp_size=4), ["--pipeline-model-parallel-size 4", "--num-layers 10",
                                      "--decoder-first-pipeline-num-layers"]),
    (dict(num_layers=10, pp_size=4, first=2, last=3), ["--decoder-first-pipeline-num-layers 2",
                                                       "--decoder-last-pipeline-num-layers 3",
                                                       "--pipeline-model-parallel-size 4"]),
    (dict(num_layers=6, pp_size=2, first=2, last=3), ["--decoder-first-pipeline-num-layers 2", "left over"]),
    (dict(num_layers=4, pp_size=3, first=5), ["--decoder-first-pipeline-num-layers 5"]),
    (dict(num_layers=8, pp_size=2, vpp_layers=3), ["--num-layers-per-virtual-pipeline-stage 3",
                                                   "--pipeline-model-parallel-size 2"]),
    (dict(num_layers=8, pp_size=2, vpp_layers=2, first=2), ["--num-layers-per-virtual-pipeline-stage",
                                                            "--decoder-first-pipeline-num-layers"]),
    (dict(num_layers=4, pp_size=1, last=2), ["--pipeline-model-parallel-size > 1"]),
    # middle stages with no layer hold no parameter at all: the optimizer's 'empty parameter list' traceback
    (dict(num_layers=4, pp_size=4, first=2, last=2), ["--decoder-first-pipeline-num-layers 2", "stages 1, 2 would hold"]),
    (dict(num_layers=4, pp_size=4, last=4), ["--decoder-last-pipeline-num-layers 4", "stages 1, 2 would hold no"]),
    (dict(num_layers=3, pp_size=3, first=3), ["stage 1 would hold no layers"]),
])
def test_errors_name_the_flags(kwargs, flags):
    with pytest.raises(ValueError) as err:
        layer_ranges(**kwargs)
    for flag in flags:
        assert flag in str(err.value)
