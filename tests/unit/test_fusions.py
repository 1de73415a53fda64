"""The fused functions (megatron_lite/fusions/) against their unfused references and Megatron's formulas.

fp32: forward and both gradients within 1e-6; bf16: within bf16's resolution (rtol 2^-7) of the fp32
reference. The same checks run through ``torch.compile`` (backend aot_eager: Dynamo + AOTAutograd,
no C++ build, so it is cheap; the Inductor path is exercised by tests/e2e/test_torch_compile.py).
The flags and the pieces in a model (a fused GPT against the unfused one, gradient-accumulation
fusion): tests/unit/test_fusions_in_model.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_lite.fusions.activations as activations
from megatron_lite.fusions import bias_dropout_add, bias_gelu_impl, bias_swiglu_impl, set_jit_fuser
from megatron_lite.fusions.dropout import dropout
from megatron_lite.models import TransformerConfig
from megatron_lite.models.attention import unfused_attention
from megatron_lite.parallel.state import ParallelState
from tests.model_helpers import FUSION_MODEL


def megatron_gelu(x):  # Megatron's fused GeLU, written from its published formula
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def megatron_gelu_grad(x):
    t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    return 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)


@pytest.fixture(params=["eager", "eager_blocks", "compiled"])
def jit_mode(request, monkeypatch):
    """Run the fused functions eagerly (as a small CPU call runs: PyTorch's own kernels under autograd;
    ``eager_blocks``: through the autograd Functions and their CPU blocks, several, the last one short, as
    a large call runs), and through torch.compile (aot_eager backend)."""
    if request.param == "eager_blocks":
        monkeypatch.setattr(activations, "NATIVE_BELOW", 0)
        monkeypatch.setattr(activations, "CPU_CHUNK", 300)
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
    monkeypatch.setattr(activations, "NATIVE_BELOW", 0)
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
    monkeypatch.setattr(activations, "NATIVE_BELOW", 0)
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
        config = TransformerConfig(**{**FUSION_MODEL, "masked_softmax_fusion": fused})
        attention = DotProductAttention(config, ParallelState(), 1)
        out[fused] = _grads(lambda q, k, v, attention=attention: attention(q, k, v, ids, causal), q, k, v)
    torch.testing.assert_close(out[False][0], out[True][0], rtol=1e-6, atol=1e-6)
    for g, r in zip(out[False][1], out[True][1]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
