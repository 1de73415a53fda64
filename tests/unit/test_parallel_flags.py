"""Layout and recomputation flags: a flag that would do nothing is refused in one line (exit 2), and
MEGATRON_LITE_CHECK_ARGS's summary line multiplies out to the world size."""

import pytest

from megatron_lite.arguments import parse_args

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1"]


def _one_line_exit_2(capsys, flags, world, words):
    with pytest.raises(SystemExit) as err:
        parse_args(BASE + flags, world_size=world)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), lines


@pytest.mark.parametrize("flags", [
    ["--recompute-granularity", "selective", "--recompute-num-layers", "2"],  # Megatron refuses it too
    ["--recompute-num-layers", "2"],  # no recomputation at all: it was silently ignored
])
def test_recompute_num_layers_without_full_is_refused(capsys, flags):
    _one_line_exit_2(capsys, flags, 1, ["--recompute-num-layers", "--recompute-granularity full"])


FULL = ["--recompute-granularity", "full", "--recompute-method"]


@pytest.mark.parametrize("world, flags, most", [
    (1, FULL + ["block", "--recompute-num-layers", "5"], 4),
    (1, FULL + ["uniform", "--recompute-num-layers", "5"], 4),
    (2, FULL + ["block", "--recompute-num-layers", "3", "--pipeline-model-parallel-size", "2"], 2),
    (2, FULL + ["block", "--recompute-num-layers", "2", "--pipeline-model-parallel-size", "2",
                "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "2"], 1),
])
def test_recompute_num_layers_beyond_a_model_chunk_is_refused(capsys, world, flags, most):
    """Megatron-LM counts --recompute-num-layers per model chunk, 1 to its layers; more was accepted."""
    _one_line_exit_2(capsys, flags, world, ["--recompute-num-layers", f"use at most {most}"])


@pytest.mark.parametrize("flags, n", [
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], 1),  # Megatron's default group of 1
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"], 3),
    (FULL + ["uniform", "--recompute-num-layers", "4"], 4),  # the whole stage in one group
    (["--recompute-granularity", "selective"], None),
])
def test_recompute_combinations_that_work_are_accepted(flags, n):
    assert parse_args(BASE + flags, world_size=1).training.recompute_num_layers == n


def test_recompute_num_layers_fits_the_largest_stage():
    """Uneven stages (1 + 3 layers): block 3 recomputes the first stage's layer and all three of the last."""
    flags = FULL + ["block", "--recompute-num-layers", "3", "--pipeline-model-parallel-size", "2",
                    "--decoder-first-pipeline-num-layers", "1"]
    assert parse_args(BASE + flags, world_size=2).training.recompute_num_layers == 3


@pytest.mark.parametrize("world, flags, layout", [
    (8, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"], "TP 2 x PP 1 x CP 2 x DP 2,"),
    (4, ["--context-parallel-size", "4"], "TP 1 x PP 1 x CP 4 x DP 1,"),
    (4, ["--pipeline-model-parallel-size", "2"], "TP 1 x PP 2 x DP 2,"),  # CP 1 is not shown
])
def test_check_args_summary_accounts_for_every_process(capsys, monkeypatch, world, flags, layout):
    monkeypatch.setenv("MEGATRON_LITE_CHECK_ARGS", "1")
    with pytest.raises(SystemExit) as err:
        parse_args(BASE + flags, world_size=world)
    assert err.value.code == 0
    assert f"arguments valid for world size {world}: {layout}" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["abc", "8x", ""])
def test_a_world_size_that_is_not_a_number_is_one_line_exit_2(capsys, monkeypatch, value):
    """WORLD_SIZE set by hand for MEGATRON_LITE_CHECK_ARGS: a typo was a ValueError traceback."""
    monkeypatch.setenv("MEGATRON_LITE_CHECK_ARGS", "1")
    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(SystemExit) as err:
        parse_args(BASE)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"WORLD_SIZE={value!r}" in lines[0], lines


@pytest.mark.parametrize("flag", ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_model_parallel_size_below_one_is_refused(capsys, flag, value):
    """--tensor-model-parallel-size 0 (padding the vocabulary) and --pipeline-model-parallel-size 0
    (checking the layer split) were a ZeroDivisionError traceback; now one line naming the flag."""
    _one_line_exit_2(capsys, [flag, value], 1, [f"{flag} must be at least 1, got {value}"])


def test_empty_middle_pipeline_stages_are_refused(capsys):
    """PP 4 with 2 + 2 layers on the first and last stages left stages 1 and 2 without a layer or a
    parameter: accepted, then the optimizer's 'empty parameter list' traceback on those ranks."""
    _one_line_exit_2(capsys, ["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "2",
                              "--decoder-last-pipeline-num-layers", "2"], 4,
                     ["stages 1, 2 would hold no layers", "give every middle stage at least one layer"])


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_virtual_stage_of_no_layers_is_refused_by_name(capsys, value):
    """It said 'num-layers 4 is not divisible by num-layers-per-virtual-pipeline-stage 0 x ...'."""
    _one_line_exit_2(capsys, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", value],
                     2, [f"--num-layers-per-virtual-pipeline-stage must be at least 1, got {value}"])
