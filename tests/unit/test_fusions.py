"""The fused functions (megatron_lite/fusions/) against their unfused references and Megatron's formulas.

fp32: forward and both gradients within 1e-6; bf16: within bf16's resolution (rtol 2^-7) of the fp32
reference. The same checks run through ``torch.compile`` (backend aot_eager: Dynamo + AOTAutograd,
no C++ build, so it is cheap; the Inductor path is exercised by tests/e2e/test_torch_compile.py).
Then the pieces in a model: a GPT with every fusion on computes what the unfused GPT with the
tanh GeLU computes, the flags keep Megatron's names, defaults and rules, and gradient-accumulation
fusion fills ``main_grad`` exactly as the hook does.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_lite.fusions.activations as activations
from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.fusions import bias_dropout_add, bias_gelu_impl, bias_swiglu_impl, set_jit_fuser
from megatron_lite.fusions.dropout import dropout
from megatron_lite.models import TransformerConfig
from megatron_lite.models.attention import unfused_attention
from megatron_lite.parallel.data_parallel import DistributedDataParallel
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def megatron_gelu(x):  # Megatron's fused GeLU, written from its published formula
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def megatron_gelu_grad(x):
    t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    return 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)


@pytest.fixture(params=["eager", "compiled"])
def jit_mode(request):
    """Run the fused functions eagerly, and through torch.compile (aot_eager backend)."""
    if request.param == "compiled":
        torch._dynamo.reset()
        set_jit_fuser("compile", "aot_eager")
    yield request.param
    set_jit_fuser("auto")


def _grads(fn, *inputs):
    """fn(*inputs), and the gradients of (out * fixed weights).sum() w.r.t. every input."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype)
    (out * weights).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _close(actual, expected, dtype, summed: bool = False):
    """fp32: 1e-6. bf16: rtol 2^-7; a bias gradient (``summed`` over the tokens in bf16) also carries
    the rounding of each addend, so its absolute tolerance is 2^-4."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-4 if summed else 2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_is_megatron_tanh_gelu(jit_mode, dtype):
    y, b = torch.randn(6, 3, 40) * 2, torch.randn(40)
    out, (gy, gb) = _grads(bias_gelu_impl, y.to(dtype), b.to(dtype))
    ref, (ry, rb) = _grads(lambda y, b: F.gelu(y + b, approximate="tanh"), y, b)  # fp32 reference
    _close(out, ref, dtype)
    _close(gy, ry, dtype)
    _close(gb, rb, dtype, summed=True)
    x = y + b  # and Megatron's formula itself, forward and derivative
    torch.testing.assert_close(megatron_gelu(x), ref, rtol=1e-6, atol=1e-6)
    weights = torch.linspace(-1, 1, x.numel()).view(x.shape)
    torch.testing.assert_close(megatron_gelu_grad(x) * weights, ry, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_tanh_gelu_in_chunks(monkeypatch, dtype):
    # The eager CPU forward (x sigmoid(2 v), in chunks): 7 entries per chunk, so 720 entries make 103
    # chunks, the last one short; every chunk, the tail included, must equal PyTorch's tanh GeLU.
    monkeypatch.setattr(activations, "CPU_CHUNK", 7)
    y, b = torch.randn(6, 3, 40) * 3, torch.randn(40)
    out = bias_gelu_impl(y.to(dtype), b.to(dtype))
    ref = F.gelu((y.to(dtype) + b.to(dtype)).float(), approximate="tanh")  # bf16: from the bf16 sum, rounded once
    torch.testing.assert_close(out.float(), ref, rtol=1e-6 if dtype == torch.float32 else 2**-8, atol=1e-6)
    yt = y.transpose(0, 2)  # a non-contiguous input: read and written in its logical order
    torch.testing.assert_close(activations.cpu_tanh_gelu(yt), F.gelu(yt, approximate="tanh"), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_16_bit_gelu_saves_its_derivative(monkeypatch, dtype):
    # 16-bit on the CPU: one pass over blocks of rows computes gelu(x) and gelu'(x) of x = y + bias
    # (rounded as y + bias is); the backward is then one multiply. 100-entry blocks of 40-wide rows
    # are 2 rows each, so 17 rows make 9 blocks, the last one short.
    monkeypatch.setattr(activations, "CPU_CHUNK", 100)
    y, b = torch.randn(17, 40) * 3, torch.randn(40)
    x = (y.to(dtype) + b.to(dtype)).float()
    out, derivative = activations.cpu_bias_tanh_gelu_with_grad(y.to(dtype), b.to(dtype))
    assert out.dtype == derivative.dtype == dtype and out.shape == derivative.shape == y.shape
    whole = activations.bias_gelu_with_grad(y.to(dtype), b.to(dtype))  # the compiled route's function, run eagerly
    assert torch.equal(whole[0], out) and torch.equal(whole[1], derivative)  # blocks change no bit
    torch.testing.assert_close(out.float(), F.gelu(x, approximate="tanh"), rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(derivative.float(), megatron_gelu_grad(x), rtol=2**-8, atol=1e-5)
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    leaf = y.to(dtype).requires_grad_()
    weights = torch.linspace(-1, 1, y.numel()).view(y.shape).to(dtype)
    result = bias_gelu_impl(leaf, b.to(dtype))
    with Ops():
        torch.autograd.backward(result, weights)
    assert "gelu_backward" not in seen and "tanh" not in seen
    torch.testing.assert_close(leaf.grad.float(), megatron_gelu_grad(x) * weights.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_swiglu_matches_silu_times_up(jit_mode, dtype, with_bias):
    y, b = torch.randn(5, 2, 48), torch.randn(48)

    def ref_fn(y, b=None):
        gate, up = (y if b is None else y + b).chunk(2, -1)
        return F.silu(gate) * up

    inputs = (y, b) if with_bias else (y,)
    out, grads = _grads(bias_swiglu_impl if with_bias else (lambda y: bias_swiglu_impl(y, None)),
                        *(t.to(dtype) for t in inputs))
    ref, ref_grads = _grads(ref_fn, *inputs)
    _close(out, ref, dtype)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        _close(g, r, dtype, summed=i == 1)


@pytest.mark.parametrize("training, prob", [(True, 0.3), (False, 0.3), (True, 0.0)])
def test_bias_dropout_add_is_residual_plus_dropout(jit_mode, training, prob):
    x, b, r = torch.randn(8, 2, 16), torch.randn(16), torch.randn(8, 2, 16)
    torch.manual_seed(3)
    out, grads = _grads(lambda x, b, r: bias_dropout_add(x, b, r, prob, training), x, b, r)
    torch.manual_seed(3)  # eager draws the same mask: compiled, Inductor's RNG may differ, the rate may not
    ref, ref_grads = _grads(lambda x, b, r: r + dropout(x + b, prob, training), x, b, r)
    if jit_mode == "eager" or not (training and prob > 0):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for g, e in zip(grads, ref_grads):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    else:
        kept = (out - r).ne(0).float().mean().item()
        assert abs(kept - (1 - prob)) < 0.1


@pytest.mark.parametrize("mask", ["causal", "explicit", "gqa", "value_head_size", "fully_masked_row"])
def test_unfused_attention_equals_sdpa(mask):
    """``fully_masked_row``: a query that may see no key attends to nothing (zeros, as SDPA), not NaN."""
    b, s, d = 2, 12, 8
    dv = 6 if mask == "value_head_size" else d  # MLA: values narrower than queries and keys
    nq, nkv = (4, 2) if mask == "gqa" else (4, 4)
    q, k, v = torch.randn(b, nq, s, d), torch.randn(b, nkv, s, d), torch.randn(b, nkv, s, dv)
    explicit = torch.rand(b, 1, s, s) > 0.7 if mask in ("explicit", "fully_masked_row") else None
    if explicit is not None:
        explicit[..., 0] = False  # every query sees at least one key
    if mask == "fully_masked_row":
        explicit[0, :, 3] = True  # but this one (a padding query of a user's mask)
    scale = 1 / math.sqrt(d)

    def ref_fn(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if explicit is None else ~explicit,
                                             is_causal=explicit is None, scale=scale, enable_gqa=nq != nkv)
        return out.permute(2, 0, 1, 3).reshape(s, b, nq * dv)

    out, grads = _grads(lambda q, k, v: unfused_attention(q, k, v, explicit, True, 0.0, scale), q, k, v)
    ref, ref_grads = _grads(ref_fn, q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):  # SDPA sums in another order: gradients to 1e-5
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("causal", [True, False])
def test_no_masked_softmax_fusion_with_packed_documents(causal):
    """Document ids as the mask (packed sequences): the explicit softmax path attends exactly as SDPA."""
    from megatron_lite.models.attention import DotProductAttention

    s, b, n, d = 10, 2, 4, 8
    q, k, v = (torch.randn(s, b, n, d) for _ in range(3))
    ids = torch.tensor([[0] * 3 + [1] * 4 + [2] * 3, [0] * 6 + [1] * 4])
    out = {}
    for fused in (True, False):
        attention = DotProductAttention(TransformerConfig(**{**MODEL, "masked_softmax_fusion": fused}), ParallelState(), 1)
        out[fused] = _grads(lambda q, k, v, attention=attention: attention(q, k, v, ids, causal), q, k, v)
    torch.testing.assert_close(out[False][0], out[True][0], rtol=1e-6, atol=1e-6)
    for g, r in zip(out[False][1], out[True][1]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)

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

MODEL = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=100,
             padded_vocab_size=128, attention_dropout=0.0, hidden_dropout=0.0, max_position_embeddings=16)
FUSED = dict(bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=True,
             gradient_accumulation_fusion=True, cross_entropy_loss_fusion=True)


def _loss_and_grads(config, wrap: bool):
    state = ParallelState()
    model = build_gpt_from(config, state)
    if wrap:  # one bucket per parameter, reduced as soon as it is ready: a weight marked ready before
        # its last gradient (the tied embedding, read by the output layer) raises
        model = DistributedDataParallel(model, state, overlap_grad_reduce=True, bucket_size=1)
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 100, (2, 16), generator=g), torch.randint(0, 100, (2, 16), generator=g)
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    params = model.module.named_parameters() if wrap else model.named_parameters()
    return loss.detach(), {n: (p.main_grad if wrap else p.grad).clone() for n, p in params}


def build_gpt_from(config, state):
    from megatron_lite.models import GPTModel
    torch.manual_seed(0)
    return GPTModel(config, state)


@pytest.mark.parametrize("variant", ["gelu", "swiglu_rope"])
def test_fused_gpt_equals_unfused_gpt(variant):
    """Every fusion on (run through DDP, so gradient accumulation is fused too, the tied output
    layer's included) against the unfused model with the same math (the tanh GeLU): loss and every
    gradient within fp32 rounding."""
    extra = dict(swiglu=True, position_embedding_type="rope", add_bias_linear=False) if variant != "gelu" else {}
    unfused = TransformerConfig(**MODEL, **extra, openai_gelu=True)
    fused = dataclasses.replace(unfused, openai_gelu=False, masked_softmax_fusion=False, **FUSED)
    loss, grads = _loss_and_grads(unfused, wrap=True)
    fused_loss, fused_grads = _loss_and_grads(fused, wrap=True)
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

    config = TransformerConfig(**MODEL, gradient_accumulation_fusion=True)
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
