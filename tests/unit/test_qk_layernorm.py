"""--qk-layernorm on standard attention (Megatron-LM's; Qwen3's q_norm / k_norm): a --normalization norm
over each head's channels, one weight shared by every head, on queries and keys after the QKV
projection and before the rotation. The model against the independent reference of
test_gpt_model.py (which norms q and k per head before its complex-number rotation) with random
norm weights (and LayerNorm biases), fp32 rtol 1e-5; --apply-layernorm-1p; the parameters and their
TP-sum mark; the refusals. TP2 (+SP): tests/distributed/test_gpt_model.py (variants K, L) and
tests/e2e/test_model_family_flags.py; Hugging Face qwen3 / qwen3_moe: tests/unit/test_hf_qwen3.py."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.models.attention import SelfAttention, head_norm
from megatron_lite.models.common import Norm
from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused
from tests.model_helpers import build_gpt, transformer_config
from tests.unit.test_gpt_model import _close, make_batch, make_config, reference_logits


def _randomize_norms(model, seed=5):
    g = torch.Generator().manual_seed(seed)
    names = [n for n, _ in model.named_parameters() if "q_layernorm" in n or "k_layernorm" in n]
    with torch.no_grad():
        for name in names:
            model.get_parameter(name).add_(torch.randn(model.get_parameter(name).shape, generator=g) * 0.5)
    return names


@pytest.mark.parametrize("variant, groups", [("K", None), ("K", 1), ("L", None), ("L", 2)])
def test_matches_independent_reference(variant, groups):
    """RMSNorm (K: rope, GQA 8 heads / 4 groups, or MQA) and LayerNorm with a bias (L: learned positions)."""
    over = {} if groups is None else {"num_query_groups": groups}
    cfg = make_config(variant, **over)
    model = build_gpt(cfg, ParallelState(), seed=7)
    names = _randomize_norms(model)
    kinds = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    assert sorted(names) == sorted(f"decoder.layers.{i}.self_attention.{n}_layernorm.{k}"
                                   for i in range(cfg.num_layers) for n in "qk" for k in kinds)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert all(model.get_parameter(n).shape == (head_dim,) for n in names)  # one weight shared by every head
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tokens, _ = make_batch()
    _close(model(tokens), reference_logits(sd, cfg, tokens), "logits")
    without = build_gpt(dataclasses.replace(cfg, qk_layernorm=False), ParallelState(), seed=7)
    assert not any("layernorm" in n for n, _ in without.named_parameters())


def test_zero_centred_weights_with_apply_layernorm_1p():
    """--apply-layernorm-1p: the q/k norm weights are stored as w and scale by 1 + w (like every norm)."""
    cfg = make_config("K", apply_layernorm_1p=True)
    model = build_gpt(cfg, ParallelState(), seed=7)
    norms = [p for n, p in model.named_parameters() if "q_layernorm" in n or "k_layernorm" in n]
    assert norms and all(torch.equal(p, torch.zeros_like(p)) for p in norms)  # zero-centred at init
    _randomize_norms(model)
    sd = {k: v.detach() + (1 if "norm" in k else 0) for k, v in model.state_dict().items()}
    tokens, _ = make_batch()
    _close(model(tokens), reference_logits(sd, dataclasses.replace(cfg, apply_layernorm_1p=False), tokens), "logits")


def test_norm_epsilon_is_honoured():
    """A large --norm-epsilon changes the q/k norms' output (tiny activations): the reference, which
    uses the same epsilon, still matches."""
    cfg = make_config("K", norm_epsilon=0.5)
    model = build_gpt(cfg, ParallelState(), seed=7)
    _randomize_norms(model)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tokens, _ = make_batch()
    _close(model(tokens), reference_logits(sd, cfg, tokens), "logits")


def test_norm_weights_are_summed_over_tensor_parallel_ranks():
    """Each TP rank norms only its own heads: the replicated weights carry the mark that makes the
    training code sum their gradients over TP, with or without sequence parallelism; not at TP 1."""
    config = transformer_config(make_config("K"), ParallelState())
    for tp, marked in ((1, False), (2, True), (4, True)):
        for sp in (False, True):
            norm = head_norm(dataclasses.replace(config, sequence_parallel=sp and tp > 1), SimpleNamespace(tp_size=tp))
            assert norm.weight.sequence_parallel is marked, (tp, sp)
            assert not getattr(norm.weight, "tensor_model_parallel", False)
            assert norm.weight.shape == (config.head_dim,)
    attention = SelfAttention(config, ParallelState(), 1)
    assert isinstance(attention.q_layernorm, Norm) and isinstance(attention.k_layernorm, Norm)


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]


def test_flag_parses_without_multi_latent_attention():
    assert parse_args(BASE + ["--qk-layernorm"], world_size=1).model.qk_layernorm
    assert not parse_args(BASE, world_size=1).model.qk_layernorm  # Megatron's default: off


def test_a_spec_without_a_query_key_norming_block_is_refused(tmp_path, capsys):
    """A --spec whose self_attention is neither SelfAttention nor MLA would drop --qk-layernorm silently."""
    (tmp_path / "plain_attention.py").write_text(
        "from torch import nn\nfrom megatron_lite.models.spec import LayerSpec\n"
        "class Mine(nn.Module):\n    def __init__(self, config, state, layer_number, core_attention=None):\n"
        "        super().__init__()\n"
        "SPEC = LayerSpec(self_attention=Mine)\n"
        "def MIXED(layer):\n    return SPEC if layer == 2 else LayerSpec()\n")
    module = str(tmp_path / "plain_attention.py")
    parse_refused(capsys, BASE + ["--qk-layernorm", "--spec", module, "SPEC"], "--qk-layernorm", "--spec",
                  "SelfAttention", world_size=1)
    assert parse_args(BASE + ["--spec", module, "SPEC"], world_size=1).model.spec  # without the flag: accepted
    # one layer of the stock block was enough to accept the flag, which layer 2 then dropped
    for flag in ("--qk-layernorm", "--qk-l2-norm", "--add-qkv-bias"):
        parse_refused(capsys, BASE + [flag, "--spec", module, "MIXED"], flag, "layer 2's self_attention",
                      world_size=1)
