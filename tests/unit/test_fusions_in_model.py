"""The fusion flags and the fused pieces in a model: a GPT with every fusion on computes what the
unfused GPT with the tanh GeLU computes, the flags keep Megatron's names, defaults and rules, and
gradient-accumulation fusion fills ``main_grad`` exactly as the hook does. The fused functions alone:
tests/unit/test_fusions.py.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import megatron_lite.fusions.activations as activations
from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.models import TransformerConfig
from megatron_lite.parallel.data_parallel import DistributedDataParallel
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tests.model_helpers import FUSION_MODEL, loss_and_grads

# ---------------------------------------------------------------------------------------------
# The flags.


def _cli(*extra):
    return parse_args(["--mock-data", "--vocab-size", "64", *extra], world_size=1)


def test_flags_have_megatrons_defaults_and_rules():
    f = _cli().fusion
    assert (f.bias_gelu_fusion, f.bias_swiglu_fusion, f.bias_dropout_fusion, f.masked_softmax_fusion, f.rope_fusion,
            f.gradient_accumulation_fusion, f.cross_entropy_loss_fusion, f.no_persist_layer_norm) == (
        True, True, True, True, True, True, False, False)
    model = TransformerConfig.from_config(_cli())
    assert model.bias_activation_fusion and model.bias_dropout_fusion and model.gradient_accumulation_fusion
    off = _cli("--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
               "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--cross-entropy-loss-fusion")
    model = TransformerConfig.from_config(off)
    assert not (model.bias_activation_fusion or model.bias_dropout_fusion or model.masked_softmax_fusion
                or model.apply_rope_fusion or model.gradient_accumulation_fusion) and model.cross_entropy_loss_fusion
    # Megatron: no bias, no bias + GeLU fusion (silently); SwiGLU follows its own flag, bias or not
    assert not _cli("--disable-bias-linear").fusion.bias_gelu_fusion
    assert TransformerConfig.from_config(_cli("--disable-bias-linear", "--swiglu")).bias_activation_fusion
    assert not TransformerConfig.from_config(_cli("--swiglu", "--no-bias-swiglu-fusion")).bias_activation_fusion
    # the dataclass keeps the fusions off, as Megatron's TransformerConfig does
    assert not TransformerConfig(vocab_size=64).bias_activation_fusion
    with pytest.raises(ConfigError, match="--disable-bias-linear"):
        TransformerConfig(vocab_size=64, bias_activation_fusion=True, add_bias_linear=False)


def test_te_cross_entropy_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as err:
        _cli("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te")
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--cross-entropy-fusion-impl" in lines[0]


# ---------------------------------------------------------------------------------------------
# In a model.

FUSED = dict(bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=True,
             gradient_accumulation_fusion=True, cross_entropy_loss_fusion=True)


@pytest.mark.parametrize("route", ["native", "function"])
@pytest.mark.parametrize("variant", ["gelu", "swiglu_rope"])
def test_fused_gpt_equals_unfused_gpt(monkeypatch, variant, route):
    """Every fusion on (run through DDP, so gradient accumulation is fused too, the tied output
    layer's included) against the unfused model with the same math (the tanh GeLU): loss and every
    gradient within fp32 rounding. ``route``: the model's small activations run PyTorch's own kernels
    eagerly on a CPU; ``function``: through the fused autograd Functions, as large ones do."""
    if route == "function":
        monkeypatch.setattr(activations, "NATIVE_BELOW", 0)
    extra = dict(swiglu=True, position_embedding_type="rope", add_bias_linear=False) if variant != "gelu" else {}
    unfused = TransformerConfig(**FUSION_MODEL, **extra, openai_gelu=True)
    fused = dataclasses.replace(unfused, openai_gelu=False, masked_softmax_fusion=False, **FUSED)
    loss, grads = loss_and_grads(unfused, wrap=True)
    fused_loss, fused_grads = loss_and_grads(fused, wrap=True)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == fused_grads.keys()
    for name in grads:
        torch.testing.assert_close(fused_grads[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layer", [ColumnParallelLinear, RowParallelLinear])
def test_gradient_accumulation_fusion_fills_main_grad_like_the_hook(layer):
    """Two micro-batches: the fused GEMM's main_grad equals the hook's, the weight gets no .grad,
    and without a data-parallel wrapper the layer still returns an ordinary .grad."""
    out = {}
    for fused in (False, True):
        torch.manual_seed(0)
        lin = layer(12, 10, None, gradient_accumulation_fusion=fused)
        ddp = DistributedDataParallel(lin, ParallelState())
        ddp.zero_grad_buffer()
        for seed in (1, 2):
            x = torch.randn(4, 3, 12, generator=torch.Generator().manual_seed(seed))
            (ddp(x) ** 2).sum().backward()
        assert lin.weight.grad is None
        out[fused] = (lin.weight.main_grad.clone(), lin.bias.main_grad.clone())
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.manual_seed(0)
    plain = layer(12, 10, None, gradient_accumulation_fusion=True)
    (plain(torch.randn(4, 3, 12)) ** 2).sum().backward()
    assert plain.weight.grad is not None and plain.weight.grad.shape == (10, 12)


def test_gradient_accumulation_fusion_survives_saved_tensor_hooks():
    """Under a saved-tensor hook pair (--memory-report's tracker installs one) ``ctx.saved_tensors`` hands
    the GEMM back another tensor than the weight, without its ``accumulate_main_grad``: the fused GEMM
    must still accumulate into main_grad (no .grad), so a tied output layer (``last_use=False``) does
    not mark the weight ready a second time after its lookup did (ZeRO-2/3 raised: bucket already reduced)."""
    from megatron_lite.parallel.grad_accumulation import accumulating_linear_gemm

    table = VocabParallelEmbedding(10, 6, None, gradient_accumulation_fusion=True)
    ddp = DistributedDataParallel(table, ParallelState(), strategy="optim_grads")
    ids, x = torch.tensor([[3, 7, 3]]), torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(0))
    ddp.zero_grad_buffer()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
        logits = accumulating_linear_gemm(ddp(ids) + x, table.weight, last_use=False)
        (logits ** 2).sum().backward()
    ddp.finish_grad_sync()
    assert table.weight.grad is None
    plain = torch.nn.Parameter(table.weight.detach().clone())
    ((F.linear(F.embedding(ids, plain) + x, plain)) ** 2).sum().backward()
    torch.testing.assert_close(ddp.owned_grad(table.weight).view_as(plain), plain.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_lookup_adds_its_rows_into_main_grad(dtype):
    """Gradient-accumulation fusion of the word embedding: over two iterations of two micro-batches with
    repeated ids, main_grad holds exactly this iteration's gradient (written over last iteration's, then
    added), equal to plain autograd's dense gradient; the weight gets no .grad, and the fused lookup is
    the one that marks it ready (the bucket is reduced); without a wrapper the lookup is F.embedding's."""
    ids = [torch.tensor([[3, 7, 3], [0, 3, 9]]), torch.tensor([[9, 9, 1], [7, 2, 3]]),
           torch.tensor([[5, 5, 5], [4, 6, 8]]), torch.tensor([[1, 3, 1], [0, 0, 2]])]
    grads = [torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(4)]
    table = VocabParallelEmbedding(10, 6, None, gradient_accumulation_fusion=True, dtype=dtype)
    ddp = DistributedDataParallel(table, ParallelState(), overlap_grad_reduce=True)
    for it in range(2):
        ddp.zero_grad_buffer()
        with ddp.no_sync():
            ddp(ids[2 * it]).backward(grads[2 * it])
        ddp(ids[2 * it + 1]).backward(grads[2 * it + 1])
        assert all(bucket.launched for bucket in ddp.buckets)  # marked ready by the lookup's backward
        ddp.finish_grad_sync()
        want = sum(torch.ops.aten.embedding_dense_backward(g.float(), i, 10, -1, False)
                   for i, g in zip(ids[2 * it:2 * it + 2], grads[2 * it:2 * it + 2]))
        assert table.weight.grad is None
        torch.testing.assert_close(table.weight.main_grad, want, rtol=1e-6, atol=1e-6)
    plain = VocabParallelEmbedding(10, 6, None, gradient_accumulation_fusion=True)
    plain(ids[0]).backward(grads[0].float())
    torch.testing.assert_close(plain.weight.grad, torch.ops.aten.embedding_dense_backward(grads[0].float(), ids[0], 10, -1, False))


def test_embedding_lookup_fusion_is_off_when_mtp_reads_the_table():
    """Multi-token prediction looks the word embedding up again in the same forward: its gradients then
    meet in .grad, so the fused lookup (which marks the weight ready) is not used."""
    from megatron_lite.models.embedding import Embedding

    config = TransformerConfig(**FUSION_MODEL, gradient_accumulation_fusion=True)
    assert Embedding(config, ParallelState()).word_embeddings.gradient_accumulation_fusion
    with_mtp = dataclasses.replace(config, mtp_num_layers=1, position_embedding_type="rope")
    assert not Embedding(with_mtp, ParallelState()).word_embeddings.gradient_accumulation_fusion


def _addmm_with_out_dtype(real_addmm):
    """torch.addmm that also takes CUDA's ``out_dtype`` (emulated here: fp32 products of the 16-bit inputs)."""
    def addmm(acc, a, b, *, out_dtype=None, out=None):
        if out_dtype is None:
            return real_addmm(acc, a, b, out=out) if out is not None else real_addmm(acc, a, b)
        return real_addmm(acc, a.to(out_dtype), b.to(out_dtype), out=out)
    return addmm


def test_fp32_output_gemm_probe_accepts_only_an_exact_kernel(monkeypatch):
    from megatron_lite.parallel import grad_accumulation as ga

    probe, cpu = ga._probe_fp32_output_gemm.__wrapped__, torch.device("cpu")
    assert not ga.fp32_output_gemm(cpu, torch.bfloat16) and not probe(cpu, torch.bfloat16)  # no CPU kernel
    real = torch.addmm
    monkeypatch.setattr(torch, "addmm", _addmm_with_out_dtype(real))
    assert probe(cpu, torch.bfloat16)
    monkeypatch.setattr(torch, "addmm", lambda acc, a, b, **k: k["out"].add_(1.0))  # runs, wrong sum
    assert not probe(cpu, torch.bfloat16)


def test_bf16_weight_gradients_accumulate_in_fp32_where_the_gemm_can(monkeypatch):
    """Where the device has a GEMM with fp32 output (CUDA; emulated here), a bf16 layer's weight
    gradient goes into main_grad without being rounded to bf16 first: main_grad equals the fp32 sum of
    the two micro-batches' products of the bf16 operands; the CPU path rounds each product to bf16."""
    from megatron_lite.parallel import grad_accumulation as ga

    def run():
        torch.manual_seed(0)
        lin = ColumnParallelLinear(64, 48, None, gradient_accumulation_fusion=True).bfloat16()
        ddp = DistributedDataParallel(lin, ParallelState())
        ddp.zero_grad_buffer()
        expected = torch.zeros(48, 64)
        for seed in (1, 2):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)).bfloat16().requires_grad_()
            dy = torch.randn(8, 48, generator=torch.Generator().manual_seed(seed + 10)).bfloat16()
            ddp(x).backward(dy)
            expected += dy.float().t() @ x.detach().float()
        return lin.weight.main_grad.clone(), expected

    rounded, expected = run()
    assert not torch.equal(rounded, expected)  # CPU: each product rounded to bf16
    monkeypatch.setattr(ga, "fp32_output_gemm", lambda device, dtype: True)
    monkeypatch.setattr(torch, "addmm", _addmm_with_out_dtype(torch.addmm))
    fused, expected = run()
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-6)
