"""The fused functions' eager routes on a CPU (``--jit-fuser auto``'s choice there), which differ from the
compiled ones for speed: each equals its unfused reference, forward and backward (fp32 1e-6 or to the bit
where it runs the same operations; bf16 within its resolution), and keeps the memory the fusion promises.

* bias + SwiGLU below ``NATIVE_BELOW`` entries: PyTorch's own kernels under autograd; above, the autograd
  Function over blocks of rows, saving ``y``; bias + GeLU: its Function at every size;
* bias + dropout + residual: the residual added in place into the new tensor when large (the same bits);
* the fused cross-entropy's backward: the unfused in-place scaling (the same bits).
"""

import pytest
import torch
import torch.nn.functional as F

import megatron_lite.fusions.activations as activations
import megatron_lite.fusions.residual as residual
from megatron_lite.fusions import bias_dropout_add, bias_gelu_impl, bias_swiglu_impl
from megatron_lite.fusions.dropout import dropout
from megatron_lite.parallel import cross_entropy
from megatron_lite.parallel.cross_entropy import vocab_parallel_cross_entropy


def _run(fn, *inputs, grad_dtype=None):
    """``fn(*inputs)``, the gradients of every floating input for a fixed output gradient, the output's
    grad_fn name and the bytes autograd keeps for backward (the distinct storages of what it saved)."""
    leaves = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaves)
    weights = torch.linspace(-1, 1, out.numel()).view(out.shape).to(grad_dtype or out.dtype)
    out.backward(weights)
    return out.detach(), [t.grad for t in leaves if t.is_floating_point()], type(out.grad_fn).__name__, sum(saved.values())


def _close(actual, expected, dtype, exact=False):
    if exact:
        assert torch.equal(actual, expected)
    elif dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-4)


def _swiglu_ref(y, b=None):
    gate, up = (y if b is None else y + b).chunk(2, -1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", ["small", "large"])
def test_eager_bias_gelu_equals_the_reference(monkeypatch, size, dtype):
    """At every size and dtype the Function (no native F.gelu route: one for small fp32 calls made a
    ZB-H1 + ZeRO-2 run drift from 1F1B), saving one tensor of x's size; equal to F.gelu(y + b, tanh)."""
    y, b = torch.randn(24, 40, dtype=dtype) * 2, torch.randn(40, dtype=dtype)
    if size == "large":
        monkeypatch.setattr(activations, "NATIVE_BELOW", y.numel())
    out, grads, node, saved = _run(bias_gelu_impl, y, b)
    ref, ref_grads, _, _ = _run(lambda y, b: F.gelu(y + b, approximate="tanh"), y, b)
    assert node != "GeluBackward0"
    assert saved == y.numel() * y.element_size()  # x = y + b (or, 16-bit, gelu'(x)): one tensor
    _close(out, ref, dtype)
    for g, r in zip(grads, ref_grads):
        _close(g, r, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", ["none", "shared", "per_row"])
@pytest.mark.parametrize("size, layout", [("small", "rows"), ("large", "rows"), ("large", "transposed")])
def test_eager_swiglu_equals_the_reference_to_the_bit(monkeypatch, size, layout, bias, dtype):
    """Small: silu(x1) x2 under autograd; large: the CPU Function over blocks of rows (5 rows a block,
    the last one short), the same operations, so the same bits, forward and backward, with a bias per
    row too (the grouped experts'). A non-contiguous y is read as rows: within 1e-6 of the reference
    (PyTorch's strided silu is its scalar loop, not the vectorised one). The Function saves y alone
    (besides the bias): 2/3 of autograd's x and silu(x1)."""
    y = torch.randn(23, 48, dtype=dtype) if layout == "rows" else torch.randn(48, 23, dtype=dtype).t()
    b = {"none": None, "shared": torch.randn(48, dtype=dtype), "per_row": torch.randn(23, 48, dtype=dtype)}[bias]
    if size == "large":
        monkeypatch.setattr(activations, "NATIVE_BELOW", y.numel())
        monkeypatch.setattr(activations, "CPU_CHUNK", 5 * 48)
    inputs = (y,) if b is None else (y, b)
    out, grads, node, saved = _run(lambda *t: bias_swiglu_impl(t[0], t[1] if len(t) > 1 else None), *inputs)
    ref, ref_grads, _, ref_saved = _run(_swiglu_ref, *inputs)
    assert (node == "_CpuSwiGLUBackward") == (size == "large")
    y_bytes, bias_bytes = y.numel() * y.element_size(), 0 if b is None else b.numel() * b.element_size()
    assert ref_saved == 3 * y_bytes // 2  # x (or y) and silu(x1)
    assert saved == (y_bytes + bias_bytes if size == "large" else ref_saved)
    exact = layout == "rows"
    _close(out, ref, dtype, exact)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        _close(g, r, dtype, exact)


def test_eager_swiglu_with_an_empty_input_and_no_grad():
    """An expert that got no tokens (0 rows), and a call without autograd, through the Function."""
    for rows in (0, 3):
        y, b = torch.randn(rows, 8), torch.randn(8)
        with torch.no_grad():
            assert torch.equal(activations._CpuSwiGLU.apply(y, b), _swiglu_ref(y, b))
    y = torch.zeros(0, 8, requires_grad=True)
    activations._CpuSwiGLU.apply(y, None).sum().backward()
    assert y.grad.shape == (0, 8)


@pytest.mark.parametrize("dtype, residual_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("training, prob", [(True, 0.3), (False, 0.3)])
@pytest.mark.parametrize("large", [True, False])
def test_eager_bias_dropout_add_is_the_unfused_sum_to_the_bit(monkeypatch, large, dtype, residual_dtype, training, prob):
    """The residual added in place into the new tensor (``large``: the threshold lowered to the shape)
    gives the unfused layer's bits, forward and backward; a residual of a wider dtype (fp32 residual,
    bf16 branch) is added out of place, in fp32."""
    monkeypatch.setattr(residual, "IN_PLACE_FROM", 0 if large else 10**9)
    x, b, r = torch.randn(8, 2, 16, dtype=dtype), torch.randn(16, dtype=dtype), torch.randn(8, 2, 16, dtype=residual_dtype)
    torch.manual_seed(3)
    out, grads, _, _ = _run(lambda x, b, r: bias_dropout_add(x, b, r, prob, training), x, b, r)
    torch.manual_seed(3)
    ref, ref_grads, _, _ = _run(lambda x, b, r: r + dropout(x + b, prob, training), x, b, r)
    assert (out._version > 0) == (large and dtype == residual_dtype)  # added in place, or not
    assert out.dtype == ref.dtype == residual_dtype and torch.equal(out, ref)
    for g, e in zip(grads, ref_grads):
        assert torch.equal(g, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_fused_cross_entropy_backward_is_the_unfused_one(monkeypatch, dtype):
    """--cross-entropy-loss-fusion run eagerly scales the softmax in place (the unfused scale_rows), not
    the compiled expression: the same loss and gradient bits, padded vocabulary and label smoothing included."""
    called = []
    monkeypatch.setattr(cross_entropy.fused_scale_rows, "fn", lambda *a: called.append(1))  # the compiled route's
    logits, target = torch.randn(6, 40, dtype=dtype), torch.randint(0, 37, (6,))
    runs = [_run(lambda x, fused=fused: vocab_parallel_cross_entropy(x, target, label_smoothing=0.1, vocab_size=37,
                                                                     fused=fused),
                 logits, grad_dtype=torch.float32) for fused in (True, False)]
    assert not called
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1][0], runs[1][1][0])
