"""The start-up note of a resume at another parallel layout (megatron_lite/checkpoint/resume_notes.py):
none at the checkpoint's own layout, one line naming both layouts otherwise."""

from megatron_lite.checkpoint.resume_notes import layout_change_note, torch_file_layout

ONE = {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "vpp": None, "world_size": 1}


def test_no_note_at_the_saved_layout():
    assert layout_change_note(dict(ONE), dict(ONE)) is None
    tp2 = dict(ONE, tp=2, world_size=2)
    assert layout_change_note(tp2, dict(tp2)) is None
    assert layout_change_note(dict(ONE, vpp=1), dict(ONE)) is None  # no interleaving either way


def test_a_note_names_both_layouts():
    note = layout_change_note(dict(ONE, tp=2, ep=2, world_size=4), dict(ONE, pp=2, world_size=2))
    assert note.startswith("> note: the checkpoint was saved at TP2 x EP2 (4 ranks), this run is TP1 x PP2 (2 ranks): "
                           "it continues the saved run within floating-point rounding, not bit for bit"), note
    assert "\n" not in note


def test_another_micro_batch_size_is_noted_too():
    """The same global batch in other micro-batches: sums in another order (the saved size is compared
    only when the checkpoint records it)."""
    saved = dict(ONE, micro_batch_size=2)
    assert layout_change_note(saved, dict(ONE, micro_batch_size=2)) is None
    assert layout_change_note(dict(ONE), dict(ONE, micro_batch_size=4)) is None
    note = layout_change_note(saved, dict(ONE, micro_batch_size=4))
    assert "saved at TP1 (1 ranks), micro-batch size 2, this run is TP1 (1 ranks), micro-batch size 4: " in note, note


def test_a_torch_file_compares_what_it_records():
    """A torch model file records no CP size (its world size differs instead) and an unfolded grid's
    expert TP is its TP, which layout_of leaves out: TP2 saved and resumed unfolded gets no note."""
    saved = {"tp_size": 2, "pp_size": 1, "ep_size": 1, "etp_size": 2, "expert_grid_folded": False, "dp_size": 1,
             "vpp_size": None, "world_size": 4}
    assert layout_change_note(torch_file_layout(saved), dict(ONE, tp=2, cp=2, world_size=4)) is None
    note = layout_change_note(torch_file_layout(saved), dict(ONE, tp=2, world_size=2))
    assert note and "TP2 (4 ranks), this run is TP2 (2 ranks)" in note, note
    folded = dict(saved, etp_size=1, expert_grid_folded=True, ep_size=2)
    assert layout_change_note(torch_file_layout(folded), dict(ONE, tp=2, ep=2, etp=1, cp=2, world_size=4)) is None


def test_transformer_engine_note_only_for_its_delayed_scaling():
    from types import SimpleNamespace

    from megatron_lite.checkpoint.resume_notes import transformer_engine_note

    def precision(impl="transformer_engine", fmt="hybrid", recipe="delayed"):
        return SimpleNamespace(transformer_impl=impl, fp8_format=fmt, fp8_recipe=recipe)

    note = transformer_engine_note(precision())
    assert note.startswith("> note: --transformer-impl transformer_engine keeps the delayed-scaling FP8 amax "
                           "histories and scales inside Transformer Engine, not in checkpoints") and "\n" not in note
    assert transformer_engine_note(precision(impl="local")) is None  # ours are saved: bit for bit
    assert transformer_engine_note(precision(fmt=None)) is None  # no FP8: no scaling state
    assert transformer_engine_note(precision(recipe="tensorwise")) is None  # current scaling keeps none


def test_another_seed_or_split_is_noted():
    """--seed draws mock data and shuffles samples; --split cuts --data-path (not mock data, not per-split paths)."""
    from megatron_lite.checkpoint.resume_notes import data_order_note
    from megatron_lite.config import Config

    config = Config()
    saved = config.flat()
    assert data_order_note(saved, config) is None
    assert data_order_note({}, config) is None  # a checkpoint that records neither
    config.training.seed = 99
    assert data_order_note(saved, config) == (
        "> note: --seed 99 (the checkpoint's run: 1234): the data are drawn or split otherwise, so the resumed steps "
        "read other samples than an uninterrupted run would")
    config.training.seed = 1234
    config.data.split = "90,10,0"
    assert "--split 90,10,0 (the checkpoint's run: 969,30,1)" in data_order_note(saved, config)
    config.data.mock_data = True  # mock data has no split
    assert data_order_note(saved, config) is None


def test_rng_states_at_another_layout_are_refused_in_one_readable_line(tmp_path, monkeypatch):
    """A torch_dist checkpoint resumed at another layout without --no-load-rng: the error printed the two
    layouts as raw dicts ({'tp': 2, 'pp': 1, ...}); it names them as the resume notes do, and the fix."""
    from types import SimpleNamespace

    import pytest

    from megatron_lite.checkpoint import training
    from megatron_lite.checkpoint.format import CheckpointError

    saved = dict(ONE, tp=2, dp=2, world_size=4)
    monkeypatch.setattr(training, "read_common", lambda folder: {"config": {}, "layout": saved})
    monkeypatch.setattr(training, "check_architecture", lambda *a: None)
    monkeypatch.setattr(training, "load_dist", lambda *a: None)
    state = SimpleNamespace(tp_size=1, pp_size=2, dp_size=1, cp_size=1, ep_size=1, vpp_size=None, world_size=2)
    config = SimpleNamespace(checkpoint=SimpleNamespace(no_load_rng=False, no_load_optim=False))
    with pytest.raises(CheckpointError) as err:
        training._load_dist_here(str(tmp_path), 3, [], None, None, config, state)
    folder = tmp_path / "iter_0000003"
    assert str(err.value) == (f"checkpoint {folder} was saved at TP2 x DP2 (4 ranks), this run is TP1 x PP2 (2 ranks): "
                              "its RNG states are per rank and do not carry over to another layout; pass --no-load-rng "
                              "(or resume at TP2 x DP2 (4 ranks))")


def test_another_pipeline_split_at_the_same_size_is_noted():
    """A torch_dist checkpoint resumed at its PP size with other stage layers (a layout, or the account
    flags) sums in another order: a note, as for another layout; none for the same split."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.checkpoint.resume_notes import split_change_note

    base = ["--mock-data", "--vocab-size", "64", "--num-layers", "6", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "16", "--micro-batch-size", "1", "--pipeline-model-parallel-size", "2"]
    even = parse_args(base, world_size=2)
    layout = parse_args(base + ["--pipeline-model-parallel-layout", "Ett|ttttL"], world_size=2)
    assert split_change_note(even.flat(), even) is None
    assert split_change_note(layout.flat(), layout) is None
    note = split_change_note(even.flat(), layout)
    assert note == ("> note: the checkpoint's pipeline stages held layers 0-2 | 3-5, this run's hold 0-1 | 2-5: it "
                    "continues the saved run within floating-point rounding, not bit for bit (sums in another order; "
                    "with dropout, other masks)"), note
    assert split_change_note({**even.flat(), "pipeline_model_parallel_size": 1}, layout) is None  # the layout note's
