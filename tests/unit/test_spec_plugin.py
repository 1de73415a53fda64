"""--spec MODULE NAME: a layer spec from the user's own module (a LayerSpec or a function
layer_number -> LayerSpec, by dotted name or .py path); every way it can be wrong is refused in one
line naming --spec, exit code 2, before any model is built; and pretrain_gpt.py / pretrain_bert.py
build every layer from it."""

import os
import sys
import textwrap

import pytest
import torch

import pretrain_bert
import pretrain_gpt
from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.models.spec import LayerSpec, load_spec

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "123", "--make-vocab-size-divisible-by", "8", "--mock-data", "--lr", "1e-2",
    "--log-interval", "1", "--eval-iters", "0", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", "2",
]

SPECS = '''
import torch
from megatron_lite.models.spec import LayerSpec
from megatron_lite.models.mlp import MLP

CALLS = []


class ZeroMLP(torch.nn.Module):
    """An MLP that adds nothing: a layer built from it has no MLP parameters."""

    def __init__(self, config, state, layer_number):
        super().__init__()

    def forward(self, hidden):
        return torch.zeros_like(hidden)


default = LayerSpec()
no_mlp = LayerSpec(mlp=ZeroMLP)


def every_other(layer_number):
    CALLS.append(layer_number)
    return no_mlp if layer_number % 2 == 0 else default


def not_a_spec(layer_number):
    return "mlp"


def raises(layer_number):
    raise KeyError(layer_number)


number = 3
'''


@pytest.fixture()
def specs(tmp_path, monkeypatch):
    """my_specs.py, importable both as a file path and (on PYTHONPATH) as ``my_specs_<n>``."""
    path = tmp_path / "my_specs.py"
    path.write_text(textwrap.dedent(SPECS))
    name = f"my_specs_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SPECS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return str(path), name


def test_a_layer_spec_and_a_function_resolve_by_path_and_by_name(specs):
    path, name = specs
    assert load_spec(path, "default") == LayerSpec()
    assert load_spec(name, "default") == LayerSpec()
    assert callable(load_spec(path, "every_other"))
    config = parse_args(TINY + ["--spec", name, "every_other"])
    assert config.model.spec == [name, "every_other"]
    assert sys.modules[name].CALLS == [1, 2], "the function is checked for every layer at argument time"


@pytest.mark.parametrize("module, obj, words", [
    ("no_such_module_xyz", "default", ["--spec no_such_module_xyz default", "no module named", "PYTHONPATH"]),
    ("missing/file.py", "default", ["--spec missing/file.py default", "no such file"]),
    ("PATH", "nope", ["has no attribute nope"]),
    ("PATH", "number", ["number is a int, not a LayerSpec"]),
    ("PATH", "LayerSpec", ["LayerSpec is a type, not a LayerSpec"]),
    ("PATH", "not_a_spec", ["not_a_spec(1) returned a str, not a LayerSpec"]),
    ("PATH", "raises", ["raises(1) raised KeyError"]),
])
def test_each_wrong_spec_is_refused_in_one_line(specs, capsys, module, obj, words):
    module = specs[0] if module == "PATH" else module
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--spec", module, obj])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for w in ["--spec"] + words:
        assert w in lines[0], lines[0]


def test_a_module_that_fails_to_import_is_refused(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\nraise RuntimeError('half-written plug-in')\n")
    with pytest.raises(ConfigError, match=r"--spec .*broken.py x: importing .* failed: RuntimeError: half-written"):
        load_spec(str(bad), "x")
    assert "megatron_lite_spec_broken" not in sys.modules


def test_a_module_that_exits_on_import_is_refused(tmp_path, capsys):
    """A script given as --spec (sys.exit at import) ended the run with its exit code, 0 here, without
    training and without a word; it is refused in one line, exit 2."""
    script = tmp_path / "a_script.py"
    script.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--spec", str(script), "spec"])
    assert err.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--spec" in line and "importing" in line and "SystemExit" in line, line


CUSTOM_ATTENTION = '''
from megatron_lite.models.mla import MLASelfAttention
from megatron_lite.models.spec import LayerSpec

mla = LayerSpec(self_attention=MLASelfAttention)
'''


@pytest.mark.parametrize("flag", ["--qk-l2-norm", "--add-qkv-bias", "--rotary-interleaved", "--attention-output-gate",
                                  "--no-rope-freq 1"])
def test_a_query_key_flag_without_self_attention_is_refused(tmp_path, capsys, flag):
    """--qk-l2-norm, --add-qkv-bias and the attention flags of models/attention_config.py are applied by
    SelfAttention alone: a spec whose layers use another attention block (here MLASelfAttention, without
    --multi-latent-attention) dropped them."""
    path = tmp_path / "custom_attention.py"
    path.write_text(CUSTOM_ATTENTION)
    with pytest.raises(SystemExit) as err:
        parse_args(TINY + ["--position-embedding-type", "rope", *flag.split(), "--spec", str(path), "mla"])
    assert err.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--spec" in line and flag.split()[0] in line and "SelfAttention" in line, line


@pytest.mark.parametrize("flags, world, words", [
    (["--context-parallel-size", "2"], 2, ["DotProductAttention", "ContextParallelAttention"]),
    (["--num-experts", "2"], 1, ["--num-experts", "MoELayer"]),
    (["--multi-latent-attention", "--position-embedding-type", "rope"], 1,
     ["--multi-latent-attention", "MLASelfAttention"]),
])
def test_a_spec_that_would_drop_a_flag_is_refused(specs, capsys, flags, world, words):
    parse_args(TINY + flags, world_size=world)  # valid without --spec
    with pytest.raises(SystemExit) as err:
        parse_args(TINY + flags + ["--spec", specs[0], "default"], world_size=world)
    assert err.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    for w in ["--spec"] + words:
        assert w in line, line


def _mlp_params(result_model) -> dict[int, int]:
    return {layer.layer_number: sum(p.numel() for p in layer.mlp.parameters()) for layer in result_model.decoder.layers}


def test_pretrain_gpt_builds_every_layer_from_the_spec(specs, monkeypatch):
    path, _ = specs
    built = []
    original = pretrain_gpt.model_provider

    def spy(config, state):
        chunks = original(config, state)
        built.extend(chunks)
        return chunks

    monkeypatch.setattr(pretrain_gpt, "model_provider", spy)
    same = pretrain_gpt.main(TINY + ["--spec", path, "default"]).losses
    plain = pretrain_gpt.main(TINY).losses
    assert same == plain, "--spec with the default LayerSpec trains exactly as without it"
    custom = pretrain_gpt.main(TINY + ["--spec", path, "every_other"]).losses
    assert custom != plain and all(torch.isfinite(torch.tensor(custom)))
    counts = _mlp_params(built[-1])
    assert counts[2] == 0 and counts[1] > 0, counts  # layer 2 got ZeroMLP, layer 1 the default MLP


def test_pretrain_bert_takes_the_spec(specs):
    from megatron_lite.parallel.state import ParallelState

    config = parse_args(TINY + ["--spec", specs[0], "no_mlp"], extra_sections={"bert": pretrain_bert.BertConfig})
    pretrain_bert.set_vocab(config, pretrain_bert.build_tokenizer_for(config))
    (chunk,) = pretrain_bert.model_provider(config, ParallelState())
    assert all(sum(p.numel() for p in layer.mlp.parameters()) == 0 for layer in chunk.encoder.layers)


def test_a_checkpoint_trained_with_a_spec_loads_with_it(specs, tmp_path):
    """The spec is saved with the checkpoint's flags: the tools that rebuild a model from a checkpoint
    (tools/generate.py, the converter's loader) build the spec's layers, not the stock ones."""
    from megatron_lite.checkpoint import load_gpt_checkpoint

    save = str(tmp_path / "ckpt")
    pretrain_gpt.main(TINY + ["--spec", specs[0], "every_other", "--save", save])
    model, saved = load_gpt_checkpoint(save)
    assert saved["spec"] == [specs[0], "every_other"]
    counts = {layer.layer_number: sum(p.numel() for p in layer.mlp.parameters()) for layer in model.decoder.layers}
    assert counts[2] == 0 and counts[1] > 0, counts
    # the converter builds the spec's layers too (the stock model would miss layer 2's MLP weights)
    from megatron_lite.checkpoint.convert import build_parser, convert

    out = str(tmp_path / "tp2")
    convert(build_parser().parse_args(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron",
                                       "--load-dir", save, "--save-dir", out, "--target-tensor-parallel-size", "2"]))
    assert load_gpt_checkpoint(out)[1]["spec"] == [specs[0], "every_other"]
    # a Hugging Face export would write stock layers: refused, nothing written
    hf = str(tmp_path / "hf")
    with pytest.raises(ConfigError, match="trained with --spec .* every_other.*export is refused"):
        convert(build_parser().parse_args(["--model-type", "GPT", "--saver", "hf", "--load-dir", save, "--save-dir", hf]))
    assert not os.path.exists(hf)


def test_a_spec_path_is_saved_absolute_and_compared_as_a_file(specs, tmp_path, monkeypatch):
    """A .py spec given relative to the working directory was saved as written: tools/generate.py run
    from another folder failed with "no such file", and a resume naming the same file by another path
    was refused as another model. It is saved absolute; a resume compares the files."""
    from megatron_lite.checkpoint import load_gpt_checkpoint
    from megatron_lite.checkpoint.arch import arch_differences

    monkeypatch.chdir(tmp_path)
    save = str(tmp_path / "ckpt")
    pretrain_gpt.main(TINY + ["--spec", "my_specs.py", "every_other", "--save", save])
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    model, saved = load_gpt_checkpoint(save)
    assert saved["spec"] == [specs[0], "every_other"]
    assert sum(p.numel() for p in model.decoder.layers[1].mlp.parameters()) == 0  # the spec's layer 2
    for spelling in ("../my_specs.py", specs[0]):
        assert arch_differences(saved, parse_args(TINY + ["--spec", spelling, "every_other"]), ("spec",)) == []
    monkeypatch.chdir(tmp_path)  # a checkpoint saved with a relative path, resumed from its folder
    assert arch_differences({"spec": ["my_specs.py", "every_other"]},
                            parse_args(TINY + ["--spec", specs[0], "every_other"]), ("spec",)) == []
    assert arch_differences(saved, parse_args(TINY + ["--spec", specs[0], "default"]), ("spec",))


MOE_SPECS = '''
from megatron_lite.models.spec import LayerSpec
from megatron_lite.moe.layer import MoELayer

moe = LayerSpec(mlp=MoELayer)


def first_dense(layer_number):
    return LayerSpec() if layer_number == 1 else moe
'''


@pytest.mark.parametrize("flags, name, words", [
    (["--num-experts", "2"], "first_dense", ["--moe-layer-freq 1", "[0,1]"]),  # the default freq: every layer
    (["--num-experts", "2", "--moe-layer-freq", "2"], "first_dense", ["--moe-layer-freq 2", "[0,1]"]),
    (["--num-experts", "2", "--moe-layer-freq", "[0,1]"], "moe", ["--moe-layer-freq [0,1]", "[1,1]"]),
    ([], "moe", ["--num-experts", "MoELayer"]),
])
def test_a_spec_whose_moe_layers_differ_from_moe_layer_freq_is_refused(tmp_path, capsys, flags, name, words):
    """--moe-layer-freq (default 1: every layer) says which layers are MoE to the FLOPs count, the
    per-layer router logging and the recompute checks; a spec putting MoELayer elsewhere built other
    layers than those count (or, without --num-experts, crashed building MoELayer). Refused in one
    line naming both flags and the --moe-layer-freq that matches the spec."""
    path = tmp_path / "moe_specs.py"
    path.write_text(MOE_SPECS)
    with pytest.raises(SystemExit) as err:
        parse_args(TINY + flags + ["--spec", str(path), name])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for w in ["--spec"] + words:
        assert w in lines[0], lines[0]


def test_a_spec_agreeing_with_moe_layer_freq_trains_as_without_it(tmp_path):
    path = tmp_path / "moe_specs.py"
    path.write_text(MOE_SPECS)
    flags = TINY + ["--num-experts", "2", "--moe-layer-freq", "[0,1]"]
    assert pretrain_gpt.main(flags + ["--spec", str(path), "first_dense"]).losses == pretrain_gpt.main(flags).losses


RECORDING = '''
from megatron_lite.models.attention import DotProductAttention
from megatron_lite.models.spec import LayerSpec

SEEN = []


class Recording(DotProductAttention):
    def forward(self, q, k, v, attention_mask=None, causal=True):
        SEEN.append(None if attention_mask is None else (attention_mask.dtype, tuple(attention_mask.shape)))
        return super().forward(q, k, v, attention_mask, causal)


spec = LayerSpec(core_attention=Recording)
'''


def test_the_readme_names_the_masks_a_core_attention_of_your_own_gets(tmp_path):
    """README's recipe for a core attention gave q, k, v and the result but not attention_mask: one
    written from it failed with a shape error under --reset-attention-mask, which passes int document
    ids [b, s]. Each form it gets through pretrain_gpt.py is named in the recipe."""
    path = tmp_path / "recording.py"
    path.write_text(RECORDING)
    seen = sys.modules[load_spec(str(path), "spec").core_attention.__module__].SEEN
    pretrain_gpt.main(TINY + ["--spec", str(path), "spec"])
    assert set(seen) == {None}
    seen.clear()
    pretrain_gpt.main(TINY + ["--spec", str(path), "spec", "--reset-attention-mask"])
    assert set(seen) == {(torch.int64, (2, 16))}
    readme = open(os.path.join(os.path.dirname(pretrain_gpt.__file__), "README.md"), encoding="utf-8").read()
    recipe = " ".join(readme.split("**A new attention variant**")[1].split("- **A new MLP")[0].split())
    assert "document ids `[b, s]` with `--reset-attention-mask`" in recipe
    assert "bool `[b, 1, sq, sk]` with True = masked out" in recipe


def test_a_core_attention_of_your_own_must_say_it_is_context_parallel(tmp_path, capsys):
    """Only a DotProductAttention was refused under --context-parallel-size 2: a core attention of one's
    own, written from README's recipe, trained with each rank attending within its part of the sequence
    (step-1 loss 6.26304 vs 6.26492 in one process). It is refused unless its class sets
    context_parallel = True (it attends across the context-parallel ranks)."""
    from tests.cli_errors import parse_refused

    path = tmp_path / "own_attention.py"
    path.write_text("from torch import nn\nfrom megatron_lite.models.spec import LayerSpec\n\n\n"
                    "class Local(nn.Module):\n    def __init__(self, config, state, layer_number):\n"
                    "        super().__init__()\n\n\nclass Ring(Local):\n    context_parallel = True\n\n\n"
                    "local = LayerSpec(core_attention=Local)\nring = LayerSpec(core_attention=Ring)\n")
    cp2 = TINY + ["--context-parallel-size", "2", "--spec", str(path)]
    parse_refused(capsys, cp2 + ["local"], "--spec", "core_attention is Local", "context_parallel = True",
                  world_size=2)
    assert parse_args(cp2 + ["ring"], world_size=2).model.spec
    assert parse_args(TINY + ["--spec", str(path), "local"], world_size=1).model.spec
