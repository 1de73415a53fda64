"""The pieces of --rerun-mode validate_results: the replayable data iterator keeps references (no
copy) and replays exactly the step's items; Megatron-LM's "unexpectedly large" reference."""

import math

import torch

from megatron_lite.training.rerun import LargeValues, ReplayIterator, _same


def test_replay_keeps_references_and_replays_the_step():
    batches = [{"tokens": torch.arange(4) + i} for i in range(5)]
    replay = ReplayIterator(iter(batches))
    first = [next(replay), next(replay)]
    assert all(a is b for a, b in zip(first, batches[:2]))  # the same objects: nothing copied
    replay.rewind()
    again = [next(replay), next(replay)]
    assert all(a is b for a, b in zip(again, batches[:2]))
    assert next(replay) is batches[2]  # past the replayed items: the stream goes on


def test_large_values_reference_is_the_largest_of_the_first_samples():
    ref = LargeValues(factor=10, samples=3)
    assert not any(ref.rejects(v) for v in (1.0, -2.0, 0.5))  # the samples: never rejected
    assert not ref.rejects(19.9) and ref.rejects(20.0) and ref.rejects(-25.0)
    assert not ref.rejects(math.nan) and not ref.rejects(math.inf)  # left to the NaN/inf check
    assert ref.count == 3 and ref.largest == 2.0  # values after the samples do not move it


def test_rerun_comparison_tolerances():
    assert _same(math.nan, math.nan, 0.0) and _same(1.0, 1.0, 0.0) and not _same(1.0, 1.0 + 1e-12, 0.0)
    assert _same(100.0, 100.05, 1e-3) and not _same(100.0, 100.2, 1e-3)
    assert not _same(math.inf, 1.0, 1e-3) and not _same(math.nan, 1.0, 1e-3)


def test_weight_hash_is_bit_exact_and_reads_every_slice(monkeypatch):
    from megatron_lite.training import weight_hash
    monkeypatch.setattr(weight_hash, "SLICE", 3)  # several slices of a 10-element tensor
    t = torch.linspace(-1, 1, 10, dtype=torch.bfloat16)
    same = weight_hash.tensor_hash(t.clone())
    assert torch.equal(weight_hash.tensor_hash(t), same)
    for i in (0, 9):  # the first and the last slice
        u = t.clone()
        u.view(torch.int16)[i] += 1  # the last bit of one element
        assert not torch.equal(weight_hash.tensor_hash(u), same), i
    assert not torch.equal(weight_hash.tensor_hash(torch.tensor([0.0])), weight_hash.tensor_hash(torch.tensor([-0.0])))


def _line(rank, iteration, status, job="7"):
    return (f"ts=2026-11-29 10:00:00 node=n1 device=cuda:0 jobID={job} rank={rank} iteration={iteration} "
            f"status={status} result=nan message='a NaN/inf loss or gradient'")


def test_tracker_skips_an_iteration_reproduced_twice_on_one_rank_only(tmp_path):
    from megatron_lite.training.rerun_tracker import iterations_to_skip, read_tracker
    path = tmp_path / "t.txt"
    path.write_text("\n".join([
        _line(0, 5, "initial_run"), _line(0, 5, "first_rerun_reproducible"),
        _line(0, 5, "second_rerun_reproducible", job="8"),  # twice on rank 0: skipped
        _line(1, 9, "first_rerun_reproducible"), _line(1, 9, "RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE"),
        _line(2, 9, "first_rerun_reproducible"),  # iteration 9 on two ranks of job 7: kept
        _line(3, 11, "first_rerun_not_reproducible"), _line(3, 11, "second_rerun_not_reproducible"),  # a fault
        "",
    ]))
    assert iterations_to_skip(read_tracker(str(path))) == ([5], [9])
    assert read_tracker(str(tmp_path / "absent.txt")) == []


def test_tracker_line_of_another_shape_is_one_error_naming_it(tmp_path):
    import pytest

    from megatron_lite.errors import ConfigError
    from megatron_lite.training.rerun_tracker import append_lines, read_tracker, tracker_line
    path = tmp_path / "t.txt"
    append_lines(str(path), [tracker_line(("n", "cpu"), 0, 3, "initial_run", "[nan]", "x")])
    append_lines(str(path), ["iteration 4 went wrong"])  # rewritten whole: the first line kept
    with pytest.raises(ConfigError, match=r"t.txt:2 is not a result-rejected tracker line"):
        read_tracker(str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["t.txt"]  # no temporary file left


def test_weight_hash_group_of_one_rank_compares_nothing():
    """A group of one rank is None in ParallelState (EP2 at DP2: expert-DP of 1; TP2 at 2 ranks: DP of 1):
    it used to be read as the whole world, comparing different experts or TP shards (a false mismatch)."""
    from megatron_lite.training.weight_hash import _mismatch
    assert _mismatch(torch.zeros(3, 2, dtype=torch.int64), ["a", "b", "c"], None) is None


def test_other_hardware_compares_the_rejected_values_only():
    """A finite loss differing in its last bit on other hardware is no verdict; the NaN/inf must recur."""
    from megatron_lite.training.rerun_resume import _same_rejected
    first = [math.nan, 2.5, math.nan]
    assert _same_rejected(first, [math.nan, 2.5000001, math.nan])
    assert not _same_rejected(first, [1.0, 2.5, math.nan]) and not _same_rejected(first, [math.inf, 2.5, math.nan])
    assert _same_rejected([1.0, 2.0], [1.0, 2.0]) and not _same_rejected([1.0, 2.0], [1.5, 2.0])  # injected: all
