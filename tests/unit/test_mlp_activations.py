"""--squared-relu, --quick-geglu (with --glu-linear-offset and --activation-func-clamp-value),
--use-fused-weighted-squared-relu and --qk-l2-norm (megatron_lite/activations.py).

Each activation against its formula written out here (fp32, 1e-6; forward, and backward through
autograd on the formula), the quick-GeGLU against transformers' gpt-oss gate on the interleaved
layout, the dense MLP and the MoE experts (sequential and grouped, with biases) against fc1 / fc2
done by hand, the fused bias + activation flags leaving these activations unfused, the L2 norm
against an RMSNorm of weight 1 and before / after the rotary embedding, and the refusals. TP2 and
MoE layers at TP2 / EP2: tests/distributed/test_mlp_activations_tp.py and test_moe_layer.py.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.activations import L2Norm, MLPActivation
from megatron_lite.models.attention import SelfAttention
from megatron_lite.models.common import apply_rotary
from megatron_lite.models.mlp import MLP
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.moe.experts import GroupedExperts, SequentialExperts
from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused
from tests.moe_helpers import moe_config

TOL = dict(rtol=1e-6, atol=1e-6)


def _config(**over) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=12, init_method_std=0.5,
                hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**base, **over})


def _inputs(*shape, seed=0, scale=6.0):
    """Values of both signs well past the clamp used below (so it acts), and exact zeros."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    x.view(-1)[::7] = 0.0
    return x


def _squared_relu_formula(x):
    return torch.where(x > 0, x * x, torch.zeros_like(x))


def _quick_geglu_formula(x, offset=0.0, clamp=None):
    n = x.shape[-1] // 2
    gate, linear = x[..., :n], x[..., n:]
    if clamp is not None:
        gate, linear = torch.minimum(gate, torch.tensor(clamp)), torch.maximum(torch.minimum(linear, torch.tensor(clamp)),
                                                                                 torch.tensor(-clamp))
    return gate / (1 + torch.exp(-1.702 * gate)) * (linear + offset)


def _swiglu_formula(x, offset=0.0, clamp=None):
    n = x.shape[-1] // 2
    gate, linear = x[..., :n], x[..., n:]
    if clamp is not None:
        gate, linear = torch.minimum(gate, torch.tensor(clamp)), torch.maximum(torch.minimum(linear, torch.tensor(clamp)),
                                                                                 torch.tensor(-clamp))
    return gate / (1 + torch.exp(-gate)) * (linear + offset)


def _check_forward_backward(act, formula, x):
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = act(a), formula(b)
    torch.testing.assert_close(ya, yb, **TOL)
    dy = torch.randn(ya.shape, generator=torch.Generator().manual_seed(9))
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(a.grad, b.grad, **TOL)


CASES = {
    "squared_relu": (dict(squared_relu=True), _squared_relu_formula),
    "quick_geglu": (dict(quick_geglu=True), _quick_geglu_formula),
    "quick_geglu_gpt_oss": (dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0),
                            lambda x: _quick_geglu_formula(x, 1.0, 7.0)),
    "swiglu_offset_clamp": (dict(swiglu=True, glu_linear_offset=0.5, activation_func_clamp_value=2.0),
                            lambda x: _swiglu_formula(x, 0.5, 2.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_activation_equals_its_formula(case):
    over, formula = CASES[case]
    _check_forward_backward(MLPActivation(_config(**over)), formula, _inputs(5, 3, 24))


def test_quick_geglu_equals_gpt_oss_gate_on_the_interleaved_layout():
    """transformers' GptOssExperts gate reads [g0, u0, g1, u1, ...]; ours [g; u] (Megatron's halves)."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    hf = modeling.GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=12, num_local_experts=2))
    assert (hf.alpha, hf.limit) == (1.702, 7.0)
    x = _inputs(10, 24, seed=3)
    interleaved = torch.stack(x.chunk(2, dim=-1), dim=-1).flatten(-2)
    ours = MLPActivation(_config(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0))
    torch.testing.assert_close(ours(x), hf._apply_gate(interleaved), **TOL)


def _fill_biases(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "bias" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))


@pytest.mark.parametrize("case", ["squared_relu", "quick_geglu_gpt_oss"])
@pytest.mark.parametrize("fused", [False, True])
def test_dense_mlp_is_fc2_of_the_formula_of_fc1(case, fused):
    """fc1 is [gate; linear] (2 x ffn rows) for the gated unit; the fused bias + GeLU / SwiGLU flag
    (on in Megatron's CLI) must leave these activations as they are."""
    over, formula = CASES[case]
    cfg = _config(bias_activation_fusion=fused, bias_dropout_fusion=False, **over)
    mlp = MLP(cfg, ParallelState(), 1)
    _fill_biases(mlp)
    assert mlp.linear_fc1.weight.shape == (24 if over.get("quick_geglu") else 12, 16)
    x = _inputs(4, 2, 16, seed=1, scale=1.0)
    w1, b1 = mlp.linear_fc1.weight, mlp.linear_fc1.bias
    w2, b2 = mlp.linear_fc2.weight, mlp.linear_fc2.bias
    want = F.linear(formula(F.linear(x, w1, b1)), w2, b2)
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("case", ["squared_relu", "quick_geglu_gpt_oss"])
def test_experts_are_weighted_formula(case, grouped):
    """Each expert's output is p * fc2(act(fc1 x)) (fc2's bias weighted too), sequential or grouped;
    --use-fused-weighted-squared-relu gives the same numbers."""
    over, formula = CASES[case]
    if case == "squared_relu":
        over = dict(over, use_fused_weighted_squared_relu=True)
    cfg = moe_config(add_bias_linear=True, moe_grouped_gemm=grouped, **over)
    experts = (GroupedExperts if grouped else SequentialExperts)(cfg, ParallelState(), 1)
    _fill_biases(experts)
    counts = [3, 0, 5, 2]
    x = _inputs(sum(counts), 16, seed=2, scale=1.0)
    probs = torch.rand(sum(counts), generator=torch.Generator().manual_seed(4))
    out = experts(x, probs, counts)
    rows = []
    for e, (xe, pe) in enumerate(zip(x.split(counts), probs.split(counts))):
        if grouped:
            w1, b1, w2, b2 = experts.weight1[e].t(), experts.bias1[e], experts.weight2[e].t(), experts.bias2[e]
        else:
            fc1, fc2 = experts.local_experts[e].linear_fc1, experts.local_experts[e].linear_fc2
            w1, b1, w2, b2 = fc1.weight, fc1.bias, fc2.weight, fc2.bias
        rows.append(pe[:, None] * F.linear(formula(F.linear(xe, w1, b1)), w2, b2))
    torch.testing.assert_close(out, torch.cat(rows), rtol=1e-5, atol=1e-5)


def test_l2_norm_is_unit_mean_square_and_commutes_with_the_rotation():
    x = _inputs(6, 2, 3, 8, seed=5, scale=3.0)
    y = L2Norm(1e-6)(x)
    torch.testing.assert_close(y, x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6), **TOL)
    torch.testing.assert_close(y.square().mean(-1), torch.ones(6, 2, 3), rtol=1e-5, atol=1e-5)
    angles = torch.randn(6, 1, 1, 4, generator=torch.Generator().manual_seed(6)) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    # Megatron's place (before the rotation) equals Llama 4's (after it) to rounding
    torch.testing.assert_close(apply_rotary(L2Norm(1e-6)(x), cos, sin), L2Norm(1e-6)(apply_rotary(x, cos, sin)),
                               rtol=1e-5, atol=1e-5)


def test_attention_with_qk_l2_norm_equals_rms_qk_layernorm_of_weight_one():
    """No parameters of its own; an RMSNorm with its initial weight 1 computes the same."""
    over = dict(position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=1e-5, hidden_size=32,
                num_attention_heads=4, num_query_groups=2)
    l2 = SelfAttention(_config(qk_l2_norm=True, **over), ParallelState(), 1)
    rms = SelfAttention(_config(qk_layernorm=True, **over), ParallelState(), 1)
    plain = SelfAttention(_config(**over), ParallelState(), 1)
    assert set(dict(l2.named_parameters())) == set(dict(plain.named_parameters()))
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(8))
    angles = torch.randn(6, 1, 1, 4, generator=torch.Generator().manual_seed(6))
    rotary = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    torch.testing.assert_close(l2(x, rotary=rotary), rms(x, rotary=rotary), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(l2(x, rotary=rotary), plain(x, rotary=rotary), atol=1e-3)


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
REFUSALS = {
    "squared-relu with swiglu": (["--squared-relu", "--swiglu"], ["--swiglu", "--squared-relu", "keep one"]),
    "quick-geglu with swiglu": (["--quick-geglu", "--swiglu"], ["--swiglu", "--quick-geglu"]),
    "squared-relu with quick-geglu": (["--squared-relu", "--quick-geglu"], ["--squared-relu", "--quick-geglu"]),
    "openai-gelu with squared-relu": (["--squared-relu", "--openai-gelu"], ["drop --openai-gelu"]),
    "offset without a gate": (["--glu-linear-offset", "1.0"], ["--glu-linear-offset", "--quick-geglu"]),
    "offset with squared-relu": (["--squared-relu", "--glu-linear-offset", "1.0"], ["--glu-linear-offset"]),
    "clamp without a gate": (["--activation-func-clamp-value", "7"], ["--activation-func-clamp-value", "gated"]),
    "clamp not positive": (["--quick-geglu", "--activation-func-clamp-value", "0"], ["must be positive"]),
    "fused weighted without squared-relu": (["--use-fused-weighted-squared-relu"], ["add --squared-relu"]),
    "l2 norm with qk-layernorm": (["--qk-l2-norm", "--qk-layernorm"], ["drop --qk-layernorm"]),
    "l2 norm with MLA": (["--qk-l2-norm", "--multi-latent-attention", "--position-embedding-type", "rope"],
                         ["--qk-l2-norm", "--multi-latent-attention"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(case, capsys):
    argv, words = REFUSALS[case]
    parse_refused(capsys, BASE + argv, *words, world_size=1)


def test_flags_parse_into_the_model_section():
    from megatron_lite.arguments import parse_args

    m = parse_args(BASE + ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
                           "--qk-l2-norm", "--position-embedding-type", "rope"], world_size=1).model
    assert (m.quick_geglu, m.glu_linear_offset, m.activation_func_clamp_value, m.qk_l2_norm) == (True, 1.0, 7.0, True)
    m = parse_args(BASE + ["--squared-relu", "--use-fused-weighted-squared-relu"], world_size=1).model
    assert m.squared_relu and m.use_fused_weighted_squared_relu


@pytest.mark.parametrize("flag, value", [("squared_relu", True), ("quick_geglu", True), ("glu_linear_offset", 1.0),
                                         ("activation_func_clamp_value", 7.0), ("qk_l2_norm", True),
                                         ("softmax_type", "learnable"), ("softmax_type", "off-by-one"),
                                         ("rotary_interleaved", True), ("softmax_scale", 0.2),  # attention_config.py
                                         ("attention_output_gate", True), ("no_rope_freq", "2")])
def test_hugging_face_export_is_refused(flag, value, tmp_path):
    """No family the converter writes computes these; the export stops before writing anything."""
    from megatron_lite.checkpoint.hf_folder import save_hf
    from megatron_lite.checkpoint.reshard import ModelBundle
    from megatron_lite.config import ModelConfig
    from megatron_lite.errors import ConfigError

    cfg = dict(vars(ModelConfig(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                                disable_bias_linear=True)), vocab_size=64, **{flag: value})
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')}.*export is refused"):
        save_hf(ModelBundle(config=cfg, state_dict={}), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("style", ["auto", "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"])
def test_yarn_export_is_refused_where_the_format_would_drop_it(style, tmp_path):
    """--rope-type yarn on standard attention: the llama-style writers know only llama3 / linear scaling and
    wrote plain RoPE (transformers' log-probs then differed); only gpt_oss and deepseek_v3 write YaRN."""
    from megatron_lite.checkpoint.hf_folder import save_hf
    from megatron_lite.checkpoint.reshard import ModelBundle
    from megatron_lite.config import ModelConfig
    from megatron_lite.errors import ConfigError

    cfg = dict(vars(ModelConfig(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                                disable_bias_linear=True)), vocab_size=64, rope_type="yarn")
    with pytest.raises(ConfigError, match="--rope-type yarn.*export is refused.*gpt_oss and deepseek_v3"):
        save_hf(ModelBundle(config=cfg, state_dict={}), str(tmp_path / "hf"), style)
    assert not (tmp_path / "hf").exists()


def test_flops_count_the_gated_fc1_twice():
    """--quick-geglu's fc1 is as wide as --swiglu's; --squared-relu's as GeLU's (the MFU log)."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.moe.config import MoEConfig
    from megatron_lite.perf.flops import forward_flops_per_layer

    def flops(moe=None, **over):
        return forward_flops_per_layer(ModelConfig(ffn_hidden_size=96, **over), 2, moe)

    moe = MoEConfig(num_experts=4, moe_ffn_hidden_size=32)
    assert flops(quick_geglu=True) == flops(swiglu=True) > flops() == flops(squared_relu=True)
    assert flops(moe, quick_geglu=True) == flops(moe, swiglu=True) > flops(moe)
