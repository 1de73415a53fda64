"""A checkpoint that does not fit the run names each differing setting as the flag a user types (with
dashes, both values) and the fix that loads it: the saved value, --use-checkpoint-args, and --finetune
only where no shape differs (a weights-only load still compares the shapes, so advising it for
--hidden-size sent the user to a second refusal); another --num-layers is no layout the converter changes
(the layer-range refusal advised it). Exit code 2, one line (tests/cli_errors.py)."""

from types import SimpleNamespace

import pytest

import pretrain_gpt
from megatron_lite.checkpoint.compat import _split_mismatch
from megatron_lite.config import Config
from tests.cli_errors import refused_line
from tests.e2e.test_pretrain_gpt import _argv


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A three-iteration torch-format checkpoint of test_pretrain_gpt's MODEL (--hidden-size 32, GeLU,
    --vocab-size 123, --make-vocab-size-divisible-by 8)."""
    src = str(tmp_path_factory.mktemp("mismatch") / "src")
    pretrain_gpt.main(_argv(src, 3, []))
    return src


@pytest.mark.parametrize("change, words, finetune", [
    (["--hidden-size", "64"], ["was saved with --hidden-size 32 (this run 64)", "load it with --hidden-size 32 ",
                               "--use-checkpoint-args"], False),
    (["--num-layers", "2"], ["--num-layers 4 (this run 2)", "load it with --num-layers 4,"], False),  # not convert.py
    (["--swiglu"], ["no --swiglu (this run: --swiglu)", " without --swiglu"], False),
    (["--openai-gelu"], ["no --openai-gelu (this run: --openai-gelu)", "load it without --openai-gelu"], True),
    (["--vocab-size", "124"], ["--vocab-size 123 (this run 124)", "load it with --vocab-size 123,"], True),
    (["--make-vocab-size-divisible-by", "5"], ["--make-vocab-size-divisible-by 8 (this run 5)",
                                                "a vocabulary padded to 128 rows (this run 125)",
                                                "load it with --make-vocab-size-divisible-by 8"], True),
])
def test_a_resume_at_other_model_flags_names_them_with_dashes_and_the_fix(saved, tmp_path, capsys, change, words,
                                                                          finetune):
    line = refused_line(capsys, lambda: pretrain_gpt.main(_argv(str(tmp_path / "x"), 3, ["--load", saved] + change)),
                        *words)
    assert ("--finetune" in line) is finetune, line
    if finetune:  # the advice works: a weights-only load takes it (the vocabulary's rows fitted)
        pretrain_gpt.main(_argv(str(tmp_path / "ft"), 3, ["--load", saved, "--finetune"] + change))
    else:  # a shape differs: --finetune is refused too (the refusal used to advise it)
        refused_line(capsys, lambda: pretrain_gpt.main(_argv(str(tmp_path / "ft"), 3, ["--load", saved, "--finetune"]
                                                             + change)), words[0].split(" (")[0])
    assert "padded-vocab-size" not in line and " hidden-size" not in line and "convert" not in line, line


def test_another_layer_split_names_the_saved_flag_and_the_converter():
    """A torch checkpoint saved interleaved (--num-layers-per-virtual-pipeline-stage 2), resumed without:
    the refusal named a "virtual pipeline size" and told to match a flag without its value."""
    config = Config()
    saved = dict(config.flat(), num_layers_per_virtual_pipeline_stage=2)
    err = _split_mismatch("ck", "2 model chunks per rank, this run has 1", saved, config, SimpleNamespace(pp_size=2))
    assert str(err) == ("checkpoint ck was saved with 2 model chunks per rank, this run has 1 "
                        "(--num-layers-per-virtual-pipeline-stage 2): pass --num-layers-per-virtual-pipeline-stage 2, "
                        "or convert it with tools/checkpoint/convert.py --target-pipeline-parallel-size 2")
