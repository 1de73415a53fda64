"""--pipeline-model-parallel-layout and --account-for-embedding/loss-in-pipeline-split: the ranges
:func:`pipeline_ranges` gives every consumer, Megatron-LM's grammar and rules, and one clear line
(exit 2) for each layout or combination that cannot run."""

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint.convert import pretrain_flags
from megatron_lite.parallel.pipeline import pipeline_ranges
from megatron_lite.parallel.pipeline.layout import parse_layout
from tests.cli_errors import parse_refused


def _layout(text, layers, pp, mtp=None):
    return pipeline_ranges({"num_layers": layers, "pipeline_model_parallel_size": pp,
                            "pipeline_model_parallel_layout": text, "mtp_num_layers": mtp})


def _account(layers, pp, embedding=True, loss=True, vpp=None):
    return pipeline_ranges({"num_layers": layers, "pipeline_model_parallel_size": pp,
                            "num_layers_per_virtual_pipeline_stage": vpp,
                            "account_for_embedding_in_pipeline_split": embedding,
                            "account_for_loss_in_pipeline_split": loss})


@pytest.mark.parametrize("text, stages", [
    ("Et|tt|tL", ["Et", "tt", "tL"]),
    ("E|(tt|)*2,tL", ["E", "tt", "tt", "tL"]),
    ("Et*3|(tt|)*29,m|L", ["Ettt"] + ["tt"] * 29 + ["m", "L"]),  # DeepSeek-V3's, from Megatron-LM's docs
    ("E|*2tL", ["E", "", "tL"]),  # '|' repeats like a symbol
    ("(Et|)*1,t*0tL", ["Et", "tL"]),  # counts of one and zero
    ("E|(t*2|)*2,tL", ["E", "tt", "tt", "tL"]),  # a repetition inside a group
    ("E|t*10|L", ["E", "t" * 10, "L"]),
])
def test_grammar_expands_repetitions_and_drops_commas(text, stages):
    assert parse_layout(text) == stages


@pytest.mark.parametrize("text, layers, pp, mtp, ranges", [
    ("EttL", 2, 1, None, [[(0, 2)]]),
    ("Et|tt|tL", 4, 3, None, [[(0, 1)], [(1, 3)], [(3, 4)]]),
    ("E|(tt|)*2,tL", 5, 4, None, [[(0, 0)], [(0, 2)], [(2, 4)], [(4, 5)]]),  # an embedding-only first stage
    ("Ett|tt|L", 4, 3, None, [[(0, 2)], [(2, 4)], [(4, 4)]]),  # a loss-only last stage
    ("E|t*4|L", 4, 3, None, [[(0, 0)], [(0, 4)], [(4, 4)]]),  # both
    ("Et|tmL", 2, 2, 1, [[(0, 1)], [(1, 2)]]),
    # virtual stages in order: stage s is chunk s // pp of rank s % pp
    ("Et|t|tt|L", 4, 2, None, [[(0, 1), (2, 4)], [(1, 2), (4, 4)]]),
    ("E|t|tt|t|t|tmmL", 6, 3, 2, [[(0, 0), (3, 4)], [(0, 1), (4, 5)], [(1, 3), (5, 6)]]),
])
def test_valid_layouts_give_their_ranges(text, layers, pp, mtp, ranges):
    assert _layout(text, layers, pp, mtp) == ranges


@pytest.mark.parametrize("text, layers, pp, mtp, words", [
    ("", 4, 2, None, ["is empty"]),
    ("Et|tx|L", 2, 3, None, ["unknown character 'x'", "E (embedding)"]),
    ("E t|tL", 2, 2, None, ["unknown character ' '"]),
    ("E((t|)*2)*2L", 4, 2, None, ["cannot nest"]),
    ("E|()*2|tL", 1, 3, None, ["an empty group"]),
    ("E|(t*|)*2,tL", 3, 4, None, ["needs a repeat count"]),
    ("E|(t*100000|)*100000,tL", 3, 4, None, ["more than 1000000 symbols"]),
    ("Et|tt)L", 3, 2, None, ["a ')' without its '('"]),
    ("E(tt)|tL", 3, 2, None, ["a group must be repeated"]),
    ("Et*|tL", 2, 2, None, ["needs a repeat count"]),
    ("*2Et|tL", 2, 2, None, ["'*' must follow"]),
    ("Et|tt|tL", 4, 2, None, ["3 stages", "not a multiple of --pipeline-model-parallel-size 2"]),
    ("Et|tL", 2, 1, None, ["need --pipeline-model-parallel-size >= 2"]),
    ("Et|ttL", 4, 2, None, ["places 3 transformer layers", "--num-layers is 4"]),
    ("Et|tL", 2, 2, 1, ["places 0 multi-token prediction layers", "--mtp-num-layers is 1"]),
    ("tE|tL", 2, 2, None, ["the embedding E must appear once, first in the first stage"]),
    ("E|Et|tL", 2, 3, None, ["the embedding E must appear once"]),
    ("Et|Lt", 2, 2, None, ["the loss L must appear once, last in the last stage"]),
    ("Et|tL|", 2, 3, None, ["the loss L"]),
    ("Etm|tL", 2, 2, 1, ["put all of them in the last stage, just before L"]),  # Megatron-LM's standalone MTP
    ("Et|tLm", 2, 2, 1, ["the loss L"]),
    ("Em|ttL", 2, 2, 1, ["just before L"]),
    ("Et||tL", 2, 3, None, ["stage 1 (pipeline rank 1) would hold no layers and no parameters"]),
    ("Et|m|tt|L", 3, 2, 1, ["just before L"]),
    ("Et|tt|E|tL", 4, 2, None, ["the embedding E"]),
    ("E|t|tt|(|)*2,tL", 4, 3, None, ["stage 3 (pipeline rank 0, virtual stage 1) would hold no layers"]),
])
def test_bad_layouts_give_one_clear_error(text, layers, pp, mtp, words):
    with pytest.raises(ValueError) as err:
        _layout(text, layers, pp, mtp)
    line = str(err.value)
    assert "\n" not in line and line.startswith("--pipeline-model-parallel-layout")
    for word in words:
        assert word in line, line


def test_account_for_embedding_and_loss_split_evenly_with_them():
    assert _account(6, 4) == [[(0, 1)], [(1, 3)], [(3, 5)], [(5, 6)]]  # 6 layers + 2 over PP4: 1, 2, 2, 1
    assert _account(5, 3, loss=False) == [[(0, 1)], [(1, 3)], [(3, 5)]]
    assert _account(5, 3, embedding=False) == [[(0, 2)], [(2, 4)], [(4, 5)]]
    assert _account(4, 1) == [[(0, 4)]]  # one stage holds everything
    # interleaved: vpp_layers slots per virtual stage, the embedding's slot first, the loss's last
    assert _account(6, 2, vpp=2) == [[(0, 1), (3, 5)], [(1, 3), (5, 6)]]
    assert _account(4, 2, vpp=1) == [[(0, 0), (1, 2), (3, 4)], [(0, 1), (2, 3), (4, 4)]]


@pytest.mark.parametrize("layers, pp, embedding, vpp, words", [
    (6, 4, False, None, ["--num-layers 6 + 1 (--account-for-loss-in-pipeline-split) = 7",
                         "not divisible by --pipeline-model-parallel-size 4"]),
    (6, 2, True, 3, ["= 8 is not divisible by --num-layers-per-virtual-pipeline-stage 3 x "
                     "--pipeline-model-parallel-size 2"]),
])
def test_account_flags_name_what_does_not_divide(layers, pp, embedding, vpp, words):
    with pytest.raises(ValueError) as err:
        _account(layers, pp, embedding=embedding, vpp=vpp)
    for word in words:
        assert word in str(err.value)


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1"]
LAYOUT = ["--pipeline-model-parallel-layout"]


def test_flags_parse_and_imply_the_virtual_stages():
    config = parse_args(BASE + ["--pipeline-model-parallel-size", "2", *LAYOUT, "Et|t|tt|L",
                                "--global-batch-size", "4"], world_size=2)
    assert config.parallel.pipeline_model_parallel_layout == "Et|t|tt|L"
    config = parse_args(BASE + ["--num-layers", "6", "--pipeline-model-parallel-size", "4",
                                "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
                        world_size=4)
    assert pipeline_ranges(config.flat()) == [[(0, 1)], [(1, 3)], [(3, 5)], [(5, 6)]]


@pytest.mark.parametrize("flags, world, words", [
    (["--pipeline-model-parallel-size", "2", *LAYOUT, "Et|tt|L", "--decoder-first-pipeline-num-layers", "1"], 2,
     ["--pipeline-model-parallel-layout sets every stage's layers", "drop --decoder-first-pipeline-num-layers"]),
    (["--pipeline-model-parallel-size", "2", *LAYOUT, "Ett|ttL", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     ["drop --num-layers-per-virtual-pipeline-stage"]),
    (["--pipeline-model-parallel-size", "2", *LAYOUT, "Ett|ttL", "--account-for-loss-in-pipeline-split"], 2,
     ["drop --account-for-loss-in-pipeline-split"]),
    (["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
      "--decoder-last-pipeline-num-layers", "1"], 2,
     ["--account-for-embedding-in-pipeline-split cannot be combined with --decoder-first/last-pipeline-num-layers"]),
    (["--pipeline-model-parallel-size", "2", *LAYOUT, "Et|t|t|tL", "--pipeline-schedule", "zb-h1",
      "--global-batch-size", "3"], 2, ["multiple of --pipeline-model-parallel-size 2"]),
    (["--pipeline-model-parallel-size", "2", *LAYOUT, "Et|t|t|tL", "--global-batch-size", "3"], 2,
     ["multiple of --pipeline-model-parallel-size 2"]),
    (["--pipeline-model-parallel-size", "2", *LAYOUT, "Et|tL"], 2, ["places 2 transformer layers", "--num-layers is 4"]),
    (["--pipeline-model-parallel-size", "2", *LAYOUT, "Et|tttm", "--mtp-num-layers", "1",
      "--position-embedding-type", "rope"], 2, ["the loss L"]),
])
def test_cli_refuses_in_one_line(capsys, flags, world, words):
    parse_refused(capsys, BASE + flags, *words, world_size=world)


def test_converter_tells_the_flags_that_load_the_layout():
    config = {"num_layers": 4, "pipeline_model_parallel_size": 4, "pipeline_model_parallel_layout": "E|tt|t|tL",
              "account_for_loss_in_pipeline_split": True}
    flags = pretrain_flags(config, release=True)
    assert flags[flags.index("--pipeline-model-parallel-layout") + 1] == "E|tt|t|tL"
    assert "--account-for-loss-in-pipeline-split" in flags
