"""--spec against the flags that describe the model: a flag a spec's module would not read is refused
in one line, not silently dropped (activation flags with a custom MLP, norm flags with a norm of one's
own, --multi-latent-attention against each layer's attention); factories of stock classes count as them."""

import os

import pytest

from megatron_lite.arguments import parse_args
from tests.unit.test_spec_plugin import CUSTOM_ATTENTION, TINY

MLA_SPECS = CUSTOM_ATTENTION + '''

def mixed(layer_number):
    return mla if layer_number == 1 else LayerSpec()
'''


@pytest.mark.parametrize("flags, name, words", [
    ([], "mla", ["layer 1's self_attention is", "MLASelfAttention", "--multi-latent-attention is not set"]),
    (["--multi-latent-attention"], "mixed", ["--multi-latent-attention is set", "layer 2's", "MLASelfAttention"]),
])
def test_multi_latent_attention_must_agree_with_every_spec_layer(tmp_path, capsys, flags, name, words):
    """The flag sizes every layer's rotary tables and softmax scale for MLA: a spec that used
    MLASelfAttention without it, or stock attention next to MLA with it, crashed in the first forward
    with a tensor size mismatch (or, with a head of --qk-pos-emb-head-dim channels, trained with the
    other kind's scale). Refused in one line; a spec with MLA in every layer takes the flag."""
    path = tmp_path / "mla_specs.py"
    path.write_text(MLA_SPECS)
    rope = ["--position-embedding-type", "rope"]
    parse_args(TINY + rope + ["--multi-latent-attention", "--spec", str(path), "mla"])
    with pytest.raises(SystemExit) as err:
        parse_args(TINY + rope + flags + ["--spec", str(path), name])
    assert err.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    for w in ["--spec"] + words:
        assert w in line, line


WRAPPED = '''
import functools
from megatron_lite.models.attention import DotProductAttention
from megatron_lite.models.spec import LayerSpec

partial_core = LayerSpec(core_attention=functools.partial(DotProductAttention))
'''


def test_a_factory_wrapping_a_class_counts_as_that_class(tmp_path, capsys):
    """The flag checks see through a factory that builds a stock class: int8_gemm.py's wrapped
    SelfAttention norms queries and keys (--qk-layernorm is honoured, not refused), and a
    functools.partial of DotProductAttention sees only this rank's part of the sequence (refused under
    --context-parallel-size 2, not let through to train on wrong numbers)."""
    int8 = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "research", "int8_gemm.py")
    parse_args(TINY + ["--qk-layernorm", "--spec", int8, "spec"])
    path = tmp_path / "wrapped_specs.py"
    path.write_text(WRAPPED)
    with pytest.raises(SystemExit) as err:
        parse_args(TINY + ["--context-parallel-size", "2", "--spec", str(path), "partial_core"], world_size=2)
    assert err.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--spec" in line and "ContextParallelAttention" in line, line


@pytest.mark.parametrize("flags", [["--swiglu"], ["--squared-relu"], ["--quick-geglu"], ["--openai-gelu"],
                                   ["--swiglu", "--activation-func-clamp-value", "7"]])
def test_an_activation_flag_with_a_custom_mlp_is_refused(capsys, flags):
    """squared_relu.py's MLP computes relu(x)^2 whatever the flags say: --swiglu (and the other MLP
    activation flags) would be silently dropped, so they are refused; the stock MLP takes them."""
    squared = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "research", "squared_relu.py")
    with pytest.raises(SystemExit) as err:
        parse_args(TINY + flags + ["--spec", squared, "spec"])
    assert err.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    for w in ["--spec", flags[0], "SquaredReLUMLP", "megatron_lite.models.mlp.MLP"]:
        assert w in line, line
    parse_args(TINY + flags + ["--spec", squared.replace("squared_relu", "sliding_window"), "spec"])


OWN_NORM = '''
import torch
from megatron_lite.models.common import Norm
from megatron_lite.models.spec import LayerSpec


class Tanh(torch.nn.Module):
    def __init__(self, config, state=None, layer_number=None):
        super().__init__()

    def forward(self, x):
        return torch.tanh(x)


class Scaled(Norm):
    pass


every = LayerSpec(input_norm=Tanh, pre_mlp_norm=Tanh, final_norm=Tanh)
final_only = LayerSpec(final_norm=Tanh)
subclass = LayerSpec(input_norm=Scaled.from_config, pre_mlp_norm=Scaled.from_config, final_norm=Scaled.from_config)
'''


@pytest.mark.parametrize("flags", [["--normalization", "RMSNorm"], ["--apply-layernorm-1p"]])
def test_a_norm_flag_with_a_norm_of_ones_own_is_refused(capsys, tmp_path, flags):
    """A norm of one's own (in a layer, or only the final one) does not read --normalization or
    --apply-layernorm-1p: refused, not silently dropped; the stock Norm and its subclasses take them."""
    path = tmp_path / "own_norm.py"
    path.write_text(OWN_NORM)
    for name in ("every", "final_only"):
        with pytest.raises(SystemExit) as err:
            parse_args(TINY + flags + ["--spec", str(path), name])
        assert err.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        for w in ["--spec", flags[0], "Tanh", "megatron_lite.models.common.Norm"]:
            assert w in line, line
    parse_args(TINY + flags + ["--spec", str(path), "subclass"])
    parse_args(TINY + ["--spec", str(path), "every"])  # the default --normalization LayerNorm: nothing dropped
