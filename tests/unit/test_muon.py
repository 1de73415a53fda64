"""--optimizer muon (megatron_lite/optim/muon.py) against plain references, in one process.

* Newton-Schulz: near-orthogonal output after 5 steps (singular values within 5% of 1),
  equal to the formula written out (fp32: atol 1e-5 on entries of order 0.3; the products associate differently), tall matrices through the transpose, batched
  equals one matrix at a time; the scale modes' factors.
* One step of a small model equals the update written by hand: Muon (decoupled weight decay, averaged
  momentum, Nesterov, the spectral factor, the extra factor) for the matrices, torch's AdamW for the
  embedding, norm and bias; a fused QKV weight split into its Q, K and V rows per query group.
* Which tensors of a GPT (GQA, SwiGLU, grouped and sequential experts) Muon steps.
* state_dict round trip: k steps, save, load into fresh objects, continue == the uninterrupted run.
"""

import io

import pytest
import torch
from torch import nn

from megatron_lite.config import OptimizerConfig
from megatron_lite.optim.muon import COEFFICIENTS, MuonMatrix, Orthogonalizer, newton_schulz, scale_factor
from megatron_lite.optim.optimizer import MegatronOptimizer
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import ColumnParallelLinear


def _reference_ns(x, steps):
    """The iteration written out: X / |X|_F, then X <- a X + b (X X^T) X + c (X X^T)^2 X on the wide side."""
    tall = x.shape[0] > x.shape[1]
    X = x.T if tall else x
    X = X / X.norm()
    for i in range(steps):
        a, b, c = COEFFICIENTS[i % len(COEFFICIENTS)]
        A = X @ X.T
        X = a * X + b * A @ X + c * A @ A @ X
    return X.T if tall else X


@pytest.mark.parametrize("shape", [(6, 10), (12, 5)])
def test_newton_schulz_is_near_orthogonal_and_the_plain_formula(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(newton_schulz(x, 7), _reference_ns(x, 7), rtol=1e-5, atol=1e-5)  # 7: cycled
    got = newton_schulz(x, 5)
    torch.testing.assert_close(got, _reference_ns(x, 5), rtol=1e-5, atol=1e-5)
    s = torch.linalg.svdvals(got)
    assert s.min() > 0.95 and s.max() < 1.05, s  # near-orthogonal after the five quintic steps
    u, _, v = torch.linalg.svd(x, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(got.flatten(), (u @ v).flatten(), dim=0) > 0.97
    batched = newton_schulz(torch.stack([x, 2 * x]), 5)
    torch.testing.assert_close(batched[1], newton_schulz(x, 5), rtol=1e-5, atol=1e-5)
    assert newton_schulz(x, 5, bf16=True).dtype == torch.float32


def test_scale_modes():
    assert scale_factor(8, 2, "spectral") == 8 ** 0.5
    assert scale_factor(8, 2, "unit_rms_norm") == 2.0
    assert scale_factor(2, 8, "shape_scaling") == 1.0 and scale_factor(8, 2, "shape_scaling") == 2.0


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 6)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.fc = ColumnParallelLinear(6, 8)  # weight 8 x 6 and a bias
        self.norm = nn.LayerNorm(8)


def _config(**kw):
    base = dict(optimizer="muon", lr=0.1, weight_decay=0.5, clip_grad=0.0, muon_fp32_matmul_prec="high")
    return OptimizerConfig(**{**base, **kw})


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.main_grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("nesterov", [False, True])
def test_two_steps_equal_the_update_by_hand(nesterov):
    model, ref = Tiny(), Tiny()
    opt = MegatronOptimizer([model], ParallelState(), _config(muon_use_nesterov=nesterov, muon_momentum=0.8,
                                                               muon_extra_scale_factor=0.3))
    assert set(opt.muon) == {model.fc.weight}
    adam = torch.optim.AdamW([{"params": [ref.embedding.weight], "weight_decay": 0.5},
                              {"params": [ref.fc.bias, ref.norm.weight, ref.norm.bias], "weight_decay": 0.0}], lr=0.1)
    buf = torch.zeros_like(ref.fc.weight)
    for seed in (1, 2):  # two steps: from the second on, the buffer is no longer a multiple of the gradient
        _grads(model, seed)
        _grads(ref, seed)
        opt.step()
        for p in ref.parameters():
            p.grad = p.main_grad
        w, g = ref.fc.weight.detach(), ref.fc.weight.main_grad
        buf = 0.8 * buf + 0.2 * g
        u = g + 0.8 * (buf - g) if nesterov else buf
        expected = w * (1 - 0.1 * 0.5) - 0.1 * 0.3 * 8 ** 0.5 * _reference_ns(u, 5)
        with torch.no_grad():
            ref.fc.weight.copy_(expected)
        adam.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)
    assert opt.state_dict()["optimizer"]["param_groups"][0]["muon_momentum"] == 0.8


def test_qkv_split_per_query_group():
    """Two query groups of (2 query heads, 1 key, 1 value) x head size 2: all Q rows one matrix, all K rows one,
    all V rows one, each with its own spectral factor; --muon-no-split-qkv's whole-matrix update differs."""
    u = torch.randn(2 * 8, 5, generator=torch.Generator().manual_seed(3))
    ortho = Orthogonalizer(_config())
    got = ortho(u, MuonMatrix(qkv=(4, 2, 2))).view(2, 8, 5)
    parts = u.view(2, 8, 5).split([4, 2, 2], dim=1)
    for part, rows in zip(parts, ([0, 4], [4, 6], [6, 8])):
        whole = part.reshape(-1, 5)
        expected = _reference_ns(whole, 5) * max(whole.shape) ** 0.5
        torch.testing.assert_close(got[:, rows[0]:rows[1]].reshape(-1, 5), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ortho(u, MuonMatrix()), got.view(16, 5), atol=1e-3)


def test_which_tensors_muon_steps():
    """A GPT (GQA, SwiGLU, biases, untied output layer): the attention and MLP weights, Q/K/V split by
    (query heads x head size, head size, head size); not the embeddings, output layer, norms, biases.
    Experts: a sequential expert's matrices, a grouped experts' stacked weights (per expert), not their biases."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.moe.experts import GroupedExperts, SequentialExperts
    from tests.model_helpers import build_gpt
    from tests.moe_helpers import moe_config

    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                      group_query_attention=True, seq_length=8, max_position_embeddings=8, vocab_size=32,
                      padded_vocab_size=32, swiglu=True, ffn_hidden_size=24, untie_embeddings_and_output_weights=True)
    model = build_gpt(cfg, ParallelState())
    opt = MegatronOptimizer([model], ParallelState(), _config())
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(m)] for m in opt.muon)
    dense = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
    assert muon == sorted(n for n in names.values() if n.endswith(dense)) and len(muon) == 8, muon
    assert all((opt.muon[m].qkv == (8, 4, 4)) == names[id(m)].endswith("qkv.weight") for m in opt.muon)
    experts = moe_config(num_experts=2, add_bias_linear=True)
    for module in (SequentialExperts(experts, ParallelState(), 1), GroupedExperts(experts, ParallelState(), 1)):
        opt = MegatronOptimizer([module], ParallelState(), _config())
        names = {id(p): n for n, p in module.named_parameters()}
        assert sorted(names[id(m)] for m in opt.muon) == sorted(n for n in names.values() if "weight" in n), names
        assert all(info.transposed == (m.dim() == 3) for m, info in opt.muon.items())


def test_state_dict_round_trip_is_exact():
    def run(steps, opt=None, model=None):
        model = model or Tiny()
        opt = opt or MegatronOptimizer([model], ParallelState(), _config(muon_use_nesterov=True))
        for s in steps:
            _grads(model, s)
            opt.step()
        return model, opt

    whole, _ = run(range(4))
    model, opt = run(range(2))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    fresh = Tiny()
    fresh.load_state_dict(saved["model"])
    fresh_opt = MegatronOptimizer([fresh], ParallelState(), _config(muon_use_nesterov=True))
    fresh_opt.load_state_dict(saved["optim"])
    run(range(2, 4), fresh_opt, fresh)
    for (name, p), q in zip(whole.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
