"""Hybrid Mamba-2 models (models/mamba.py, models/mamba_config.py).

* The whole mixer equals its formula written out step by step in the test (in_proj's group-major
  split, the causal conv1d, the recurrence per head, D, the gated RMSNorm per group; float64).
* The chunked SSD scan equals the step-by-step recurrence (fp32, 1e-5 of the output's scale) for chunk
  sizes that divide the sequence, do not divide it, and exceed it; its backward passes gradcheck
  (float64, every input, several chunks), and so does the whole mixer's (input and parameters).
* The layer pattern: Megatron-LM's ratio allocation, an override pattern checked against the ratios'
  counts, and every bad pattern refused in one line naming --hybrid-override-pattern.
* The model: a hybrid GPT has the layers its pattern says (an MLP layer has no attention, a Mamba or
  attention layer no MLP), trains a step, and the flags it does not build are refused (exit 2).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.errors import ConfigError
from megatron_lite.models.gpt import GPTModel
from megatron_lite.models.mamba import MambaMixer, sequential_scan, ssd_scan
from megatron_lite.models.mamba_config import allocate_layers
from megatron_lite.models.transformer_config import TransformerConfig
from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused

TINY = dict(hidden_size=64, num_attention_heads=4, seq_length=32, mamba_state_dim=16, mamba_head_dim=16,
            mamba_num_groups=2, attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm", seed=5)


def _scan_inputs(b=2, l=32, h=4, p=16, g=2, n=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, h, p, generator=gen, dtype=dtype)
    dt = F.softplus(torch.randn(b, l, h, generator=gen, dtype=dtype))
    A = -torch.exp(torch.randn(h, generator=gen, dtype=dtype))
    B, C = (torch.randn(b, l, g, n, generator=gen, dtype=dtype) for _ in range(2))
    return x, dt, A, B, C


@pytest.mark.parametrize("chunk", [8, 5, 32, 128])
def test_chunked_scan_equals_the_sequential_recurrence(chunk):
    inputs = _scan_inputs()
    want = sequential_scan(*inputs)
    got = ssd_scan(*inputs, chunk_size=chunk)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def test_scan_backward_passes_gradcheck():
    inputs = [t.requires_grad_() for t in _scan_inputs(b=1, l=7, h=2, p=3, g=1, n=2, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda *a: ssd_scan(*a, chunk_size=3), inputs)


def _config(**over):
    return TransformerConfig(**{**TINY, "num_layers": 4, "hybrid_override_pattern": "M*M-", **over})


def test_mixer_backward_passes_gradcheck():
    cfg = _config(hidden_size=16, mamba_state_dim=4, mamba_head_dim=4, num_layers=1, hybrid_override_pattern="M",
                  params_dtype=torch.float64)
    mixer = MambaMixer(cfg, ParallelState(world_size=1, rank=0), 1)
    x = torch.randn(5, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    params = list(mixer.parameters())
    with torch.no_grad():  # away from the init's ones / zeros, so every parameter's gradient is exercised
        for p in params:
            p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(p.numel())))
    names = [n for n, _ in mixer.named_parameters()]

    def run(x, *values):
        return torch.func.functional_call(mixer, dict(zip(names, values)), (x,))

    assert torch.autograd.gradcheck(run, [x] + [p.detach().clone().requires_grad_() for p in params], fast_mode=True)


def test_ratio_allocation_follows_megatron():
    assert "".join(allocate_layers(10, 0.2, 0.0)) == "MMM*MM*MMM"
    assert "".join(allocate_layers(8, 0.25, 0.25)) == "MM*-M*M-"
    assert "".join(allocate_layers(9, 0.3, 0.0)) == "MM*M*MM*M"  # round(2.7) = 3 attention layers
    assert "".join(allocate_layers(4)) == "MMMM"
    assert allocate_layers(4, 0.25, 0.25, "M*M-") == list("M*M-")  # the ratios' counts: 1 attention, 1 MLP


@pytest.mark.parametrize("pattern, ratios, words", [
    ("M*X-", (0, 0), ["'X'", "not a layer symbol"]),
    ("M*M", (0, 0), ["3 layers", "--num-layers is 4"]),
    ("M*|M-", (0, 0), ["pipeline"]),
    ("M*ME", (0, 0), ["MoE"]),
    ("M**-", (0.25, 0.25), ["layer counts", "--hybrid-attention-ratio"]),
])
def test_bad_patterns_are_refused_naming_the_flag(pattern, ratios, words):
    with pytest.raises(ConfigError) as err:
        allocate_layers(4, *ratios, pattern)
    message = str(err.value)
    assert "--hybrid-override-pattern" in message and all(w in message for w in words), message


def test_hybrid_gpt_has_the_layers_of_its_pattern():
    model = GPTModel(_config(vocab_size=64), ParallelState(world_size=1, rank=0))
    kinds = []
    for layer in model.decoder.layers:
        mixer = layer.self_attention
        kinds.append("-" if mixer is None else "M" if isinstance(mixer, MambaMixer) else "*")
        assert (layer.mlp is None) == (mixer is not None)
    assert "".join(kinds) == "M*M-"
    names = {n for n, _ in model.named_parameters()}
    assert "decoder.layers.0.self_attention.in_proj.weight" in names and "decoder.layers.0.mlp" not in str(names)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--hybrid-override-pattern", "M*M-", "--mamba-state-dim", "16", "--mamba-head-dim", "16",
        "--mamba-num-groups", "2"]


@pytest.mark.parametrize("extra, world, words", [
    (["--context-parallel-size", "2"], 2, ["--context-parallel-size"]),
    (["--tensor-model-parallel-size", "4"], 4, ["--mamba-num-groups", "--tensor-model-parallel-size"]),
    (["--torch-compile"], 1, ["--torch-compile"]),
    (["--num-experts", "2"], 1, ["--num-experts"]),
    (["--lora-rank", "4"], 1, ["--lora-rank"]),
    (["--multi-latent-attention", "--position-embedding-type", "rope"], 1, ["--multi-latent-attention"]),
    (["--mtp-num-layers", "1", "--position-embedding-type", "rope"], 1, ["--mtp-num-layers"]),
    (["--fp8-format", "hybrid"], 1, ["--fp8-format"]),
    (["--mamba-num-groups", "3"], 1, ["--mamba-num-groups", "divide"]),
])
def test_what_is_not_built_is_refused_in_one_line(capsys, extra, world, words):
    parse_refused(capsys, BASE + extra, *words, world_size=world)


def test_mamba_sizes_without_a_hybrid_model_are_refused(capsys):
    parse_refused(capsys, ["--mock-data", "--vocab-size", "64", "--mamba-state-dim", "16"], "--mamba-state-dim",
                  "hybrid")


def test_flops_count_each_layer_by_its_kind():
    from megatron_lite.perf.flops import (
        attention_flops,
        dense_mlp_flops,
        logits_flops,
        mamba_flops,
        num_floating_point_operations,
    )

    cfg = _config(vocab_size=64)  # h 64: d_inner 128, 8 heads, 2 groups, state 16; s 32
    in_proj, out_proj, scan = 2 * 32 * 64 * (256 + 64 + 8), 2 * 32 * 128 * 64, 2 * 2 * 32 * 128 * 16
    assert mamba_flops(cfg, 1) == in_proj + out_proj + scan
    layers = 2 * mamba_flops(cfg, 1) + attention_flops(cfg, 1) + dense_mlp_flops(cfg, 1)  # M*M-
    assert num_floating_point_operations(cfg, 1) == 3 * layers + 3 * logits_flops(cfg, 1)


def _reference_mixer(mixer, hidden):
    """The mixer written out step by step from its parameters: in_proj's group-major rows split into
    z, x, B, C, dt per group; a causal conv over the last 4 steps; the recurrence per head; the gated
    RMSNorm per group; out_proj."""
    s, b, _ = hidden.shape
    G, hpg, P, N = mixer.groups, mixer.per_group, mixer.head_dim, mixer.state_dim
    proj = (hidden @ mixer.in_proj.weight.t()).reshape(s, b, G, mixer.block)
    z, xbc, dt = proj.split([hpg * P, hpg * P + 2 * N, hpg], dim=-1)
    w, bias = mixer.conv1d_weight.reshape(G, hpg * P + 2 * N, 4), mixer.conv1d_bias.reshape(G, -1)
    conv = torch.stack([sum(w[..., 3 - k] * xbc[t - k] for k in range(4) if t - k >= 0) + bias for t in range(s)])
    x, B, C = F.silu(conv).split([hpg * P, N, N], dim=-1)
    x = x.reshape(s, b, G, hpg, P)
    dt = F.softplus(dt + mixer.dt_bias.reshape(G, hpg))
    A, D = -torch.exp(mixer.A_log).reshape(G, hpg), mixer.D.reshape(G, hpg)
    state, ys = torch.zeros(b, G, hpg, P, N, dtype=hidden.dtype), []
    for t in range(s):
        update = (dt[t][..., None, None] * x[t][..., None]) * B[t][:, :, None, None, :]
        state = torch.exp(dt[t] * A)[..., None, None] * state + update
        ys.append((state * C[t][:, :, None, None, :]).sum(-1) + D[..., None] * x[t])
    y = torch.stack(ys).reshape(s, b, G, hpg * P) * F.silu(z)
    y = y / torch.sqrt((y * y).mean(-1, keepdim=True) + mixer.eps) * mixer.norm_weight.reshape(G, -1)
    return y.reshape(s, b, -1) @ mixer.out_proj.weight.t()


def test_mixer_equals_its_step_by_step_formula():
    cfg = _config(num_layers=1, hybrid_override_pattern="M", params_dtype=torch.float64)
    mixer = MambaMixer(cfg, ParallelState(world_size=1, rank=0), 1)
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(p.numel())))
    hidden = torch.randn(32, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(mixer(hidden), _reference_mixer(mixer, hidden), rtol=1e-9, atol=1e-10)
