"""The layer spec of GPTModel: a custom core attention and a custom MLP go in through the spec alone, and
the norms follow it (each layer's, the final one after the last layer, multi-token prediction's). The
model helpers are test_gpt_model.py's."""

import pytest
import torch

from megatron_lite.models import GPTModel
from megatron_lite.parallel.state import ParallelState
from tests.model_helpers import build_gpt, transformer_config
from tests.unit.test_gpt_model import _close, make_batch, make_config


def test_final_norm_comes_from_the_last_layers_spec():
    """A spec replacing the norms replaces the one after the last layer too: LayerSpec.final_norm of the
    last layer's spec, called with the last layer's number (the other layers' final_norm is not read)."""
    from megatron_lite.models import LayerSpec, TransformerBlock

    cfg = transformer_config(make_config("A"), ParallelState(), seed=1)
    calls = []

    def scaled(config, state, layer_number):
        calls.append(layer_number)
        return torch.nn.Identity()

    per_layer = lambda n: LayerSpec(final_norm=scaled) if n == cfg.num_layers else LayerSpec(final_norm=None)  # noqa: E731
    block = TransformerBlock(cfg, ParallelState(), per_layer)
    assert isinstance(block.final_norm, torch.nn.Identity) and calls == [cfg.num_layers]
    assert TransformerBlock(cfg, ParallelState(), per_layer, post_process=False).final_norm is None
    assert type(TransformerBlock(cfg, ParallelState(), LayerSpec()).final_norm).__name__ == "Norm"


def test_mtp_norms_come_from_the_spec():
    """The multi-token prediction depths' norms follow the last layer's spec like the decoder's: enorm and
    hnorm are its input_norm, final_layernorm its final_norm, each built with the depth's layer number
    num_layers + k (they were Norm.from_config whatever the spec). The default spec keeps the stock Norm."""
    from megatron_lite.models import LayerSpec

    cfg = transformer_config(make_config("A", position_embedding_type="rope", mtp_num_layers=2), ParallelState(), seed=1)
    calls = []

    def tagged(kind):
        def factory(config, state, layer_number):
            calls.append((kind, layer_number))
            return torch.nn.Identity()
        return factory

    spec = LayerSpec(input_norm=tagged("input"), pre_mlp_norm=tagged("pre_mlp"), final_norm=tagged("final"))
    model = GPTModel(cfg, ParallelState(), spec=spec)
    for k, depth in enumerate(model.mtp.layers, start=1):
        assert all(isinstance(n, torch.nn.Identity) for n in (depth.enorm, depth.hnorm, depth.final_layernorm))
        n = cfg.num_layers + k
        assert [c for c in calls if c[1] == n] == [("input", n), ("input", n), ("input", n), ("pre_mlp", n), ("final", n)]
    stock = GPTModel(cfg, ParallelState()).mtp.layers[0]
    assert {type(m).__name__ for m in (stock.enorm, stock.hnorm, stock.final_layernorm)} == {"Norm"}


# ---------------------------------------------------------------------------------------------
# The layer spec: a custom core attention and a custom MLP go in through the spec alone.


class PlainSoftmaxAttention(torch.nn.Module):
    """Core attention written out (no SDPA), counting its calls; causal only, no dropout."""

    calls = 0

    def __init__(self, config, state, layer_number):
        super().__init__()
        self.scale = config.head_dim ** -0.5

    def forward(self, q, k, v, attention_mask=None, causal=True):
        PlainSoftmaxAttention.calls += 1
        s, b, nq, d = q.shape
        group = nq // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) * self.scale
        scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
        return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, nq * d)


class ZeroMLP(torch.nn.Module):
    """An MLP that adds nothing (and has no parameters)."""

    def __init__(self, config, state, layer_number):
        super().__init__()

    def forward(self, hidden):
        return torch.zeros_like(hidden)


@pytest.mark.parametrize("variant", ["A", "B"])
def test_spec_swaps_core_attention(variant):
    from megatron_lite.models import LayerSpec

    cfg = make_config(variant)
    tokens, _ = make_batch(7)
    default = build_gpt(cfg, ParallelState(), seed=8)
    PlainSoftmaxAttention.calls = 0
    custom = build_gpt(cfg, ParallelState(), seed=8, spec=LayerSpec(core_attention=PlainSoftmaxAttention))
    assert isinstance(custom.decoder.layers[0].self_attention.core_attention, PlainSoftmaxAttention)
    _close(custom(tokens), default(tokens), "logits with a hand-written core attention")
    assert PlainSoftmaxAttention.calls == cfg.num_layers


def test_spec_swaps_mlp_per_layer():
    """A per-layer spec: layer 2's MLP replaced by one that adds nothing equals the default model
    with layer 2's fc2 zeroed (fc2's output is the MLP's output)."""
    from megatron_lite.models import LayerSpec

    cfg = make_config("A")
    tokens, _ = make_batch(8)
    custom = build_gpt(cfg, ParallelState(), seed=6,
                       spec=lambda n: LayerSpec(mlp=ZeroMLP) if n == 2 else LayerSpec())
    assert isinstance(custom.decoder.layers[1].mlp, ZeroMLP)
    assert not any(name.startswith("decoder.layers.1.mlp") for name, _ in custom.named_parameters())
    default = build_gpt(cfg, ParallelState(), seed=6)
    with torch.no_grad():
        default.decoder.layers[1].mlp.linear_fc2.weight.zero_()
        default.decoder.layers[1].mlp.linear_fc2.bias.zero_()
    _close(custom(tokens), default(tokens), "logits with layer 2's MLP replaced")
    default.decoder.layers[1].mlp.linear_fc2.bias.data.fill_(0.1)
    assert not torch.allclose(custom(tokens), default(tokens))  # the MLP really is in the path
