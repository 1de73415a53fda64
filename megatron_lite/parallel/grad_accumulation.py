"""Gradient-accumulation fusion (``--gradient-accumulation-fusion``, Megatron's default): the weight
gradient of a parallel linear layer is accumulated straight into its fp32 ``main_grad``.

Without it, the weight-gradient GEMM ``dW = dY^T X`` writes a fresh ``weight.grad`` that the
data-parallel hook then adds into ``main_grad`` (a second pass over every weight, and a new
weight-sized tensor each backward). With it, :func:`accumulating_linear_gemm` (the layer's GEMM)
runs ``main_grad.addmm_(dY^T, X)`` in its backward and tells the data-parallel wrapper the gradient
arrived (``weight.accumulate_main_grad``, set by
:class:`~megatron_lite.parallel.data_parallel.DistributedDataParallel`), so readiness, buckets and
sharded gradients behave exactly as with the hook. A weight without that attribute (no data-parallel
wrapper) gets an ordinary ``.grad``. A tied word embedding read by the output layer of the same
stage accumulates the output layer's gradient the same way without being marked ready; its lookup's
gradient, which backward always reaches last, marks it.

16-bit weights: where PyTorch has a GEMM that takes bf16/fp16 inputs and writes fp32
(``torch.addmm(..., out_dtype=torch.float32)``: CUDA builds), the product is accumulated into
``main_grad`` by the GEMM itself in fp32, as Megatron's fused weight-gradient kernels do: no 16-bit
product, no rounding of each micro-batch's gradient to 16 bits, no separate add. Whether a device
has it is decided once per device by a small probe that must reproduce the exact fp32 sum
(:func:`fp32_output_gemm`). Elsewhere (CPUs) the product is computed in the weight's dtype and
added into ``main_grad`` (the numbers the unfused path gives), still without the ``.grad`` round trip.
A weight's first gradient of an iteration is written over ``main_grad`` instead (the data-parallel
wrapper does not zero-fill the buffer between iterations).

The word-embedding lookup on a CPU (:func:`accumulating_embedding`): its gradient touches only the rows
of the ids looked up, yet the unfused path builds a dense ``vocab x hidden`` gradient (zero-filled,
then the rows added) that the data-parallel hook adds, whole, into ``main_grad``: two passes over the
table for a few thousand rows (32 ms of an fp32 step at vocabulary 32k, hidden 768, 2048 tokens, on
2 cores). Here the rows are added into ``main_grad`` directly (``index_add_``, in fp32, in id order).
Only on a CPU: there ``index_add_`` adds repeated ids in order, where a GPU's uses atomics (not
reproducible) and its dense gradient costs little.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _probe_fp32_output_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    a = (torch.randint(-8, 8, (16, 8), generator=gen) / 8).to(device, dtype)  # exact in 16 bits
    b = (torch.randint(-8, 8, (8, 16), generator=gen) / 8).to(device, dtype)
    acc = torch.full((16, 16), 0.5, device=device)
    expected = acc + a.float() @ b.float()  # small integers over 8 and 64: exact in fp32
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.equal(acc, expected))


def fp32_output_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(main_grad, a, b, out_dtype=torch.float32, out=main_grad)`` works for
    ``dtype`` inputs on ``device`` (probed once per device and dtype; never on a CPU, which has no
    such kernel)."""
    if device.type == "cpu":
        return False
    return _probe_fp32_output_gemm(torch.device(device.type, device.index or 0), dtype)


def _add_weight_grad(main_grad: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor) -> None:
    if main_grad.dtype == dy2.dtype:
        main_grad.addmm_(dy2.t(), x2)
    elif fp32_output_gemm(main_grad.device, dy2.dtype):  # the GEMM accumulates in fp32 itself
        torch.addmm(main_grad, dy2.t(), x2, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(dy2.t().mm(x2))


def _write_weight_grad(main_grad: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor) -> None:
    """The iteration's first weight gradient, written over ``main_grad`` (no zero-fill to add to)."""
    if main_grad.dtype == dy2.dtype:
        torch.mm(dy2.t(), x2, out=main_grad)
    elif fp32_output_gemm(main_grad.device, dy2.dtype):
        _add_weight_grad(main_grad.zero_(), dy2, x2)
    else:
        main_grad.copy_(dy2.t().mm(x2))


class _AccumulatingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, last_use):
        ctx.save_for_backward(x, weight)
        # The weight object itself, for its accumulate_main_grad: under a saved-tensor hook pair
        # (--memory-report's tracker) ctx.saved_tensors hands back another tensor without the attribute.
        ctx.weight = weight
        ctx.has_bias, ctx.last_use = bias is not None, last_use
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dw = None
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            accumulate = getattr(ctx.weight, "accumulate_main_grad", None)
            if accumulate is None:
                dw = dy2.t().mm(x2)
            else:
                accumulate(lambda main_grad: _add_weight_grad(main_grad, dy2, x2), ready=ctx.last_use,
                           first=lambda main_grad: _write_weight_grad(main_grad, dy2, x2))
        return dx, dw, db, None


class _AccumulatingEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight  # for its accumulate_main_grad; its values are not needed
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        rows, grads = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])

        def add(main_grad: torch.Tensor) -> None:
            main_grad.index_add_(0, rows, grads.to(main_grad.dtype))

        ctx.weight.accumulate_main_grad(add, ready=True, first=lambda main_grad: add(main_grad.zero_()))
        return None, None


def accumulates_lookup(weight: torch.Tensor) -> bool:
    """Whether a lookup of ``weight`` here goes through :func:`accumulating_embedding`: a CPU weight under a
    data-parallel wrapper, with gradients being recorded."""
    return (weight.device.type == "cpu" and weight.requires_grad and torch.is_grad_enabled()
            and getattr(weight, "accumulate_main_grad", None) is not None)


def accumulating_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose gradient rows are added straight into ``weight.main_grad`` (module
    docstring), marking the weight ready: the weight's last gradient of a backward (a tied output layer's
    comes first), and its only lookup."""
    return _AccumulatingEmbedding.apply(ids, weight)


def accumulating_linear_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                             last_use: bool = True) -> torch.Tensor:
    """``x @ weight^T + bias`` whose weight gradient is accumulated into ``weight.main_grad`` (module
    docstring); the same GEMM seam signature as :func:`~megatron_lite.parallel.tensor.linear_gemm`.
    ``last_use=False``: the weight gets another gradient later in the same backward (a tied embedding
    read by the output layer: its lookup's gradient comes last), which is the one that marks it ready."""
    return _AccumulatingLinear.apply(x, weight, bias, last_use)


def accumulating_linear_gemm_not_last(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """:func:`accumulating_linear_gemm` with ``last_use=False`` (the tied output layer's GEMM)."""
    return _AccumulatingLinear.apply(x, weight, bias, False)
