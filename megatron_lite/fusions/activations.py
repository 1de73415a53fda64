"""Fused bias + activation of the MLP (``--bias-gelu-fusion``, ``--bias-swiglu-fusion``, on by default).

The fc1 GEMM leaves its bias out (``skip_bias_add``); one function adds it and applies the
activation, and the backward is written out by hand so only one tensor per call is saved (the
activation's input; for the GeLU of 16-bit CPU tensors its derivative), not the intermediate tensors
autograd would keep. Forward and backward are separate ``jit_fuser``
functions, so each becomes a single kernel when compiled; eager, they call PyTorch's own GeLU / SiLU
kernels (one vectorised pass each), which compute the same formulas.

GeLU is the tanh approximation, as in Megatron's fused kernel (the unfused MLP uses the exact erf
form unless ``--openai-gelu``): with x = y + b and t = tanh(0.79788456 x (1 + 0.044715 x^2)),

    gelu(x)  = 0.5 x (1 + t)
    gelu'(x) = 0.5 x (1 - t^2)(0.79788456 + 0.1070322243 x^2) + 0.5 (1 + t)

(0.79788456 = sqrt(2 / pi), 0.1070322243 = 3 x 0.044715 x sqrt(2 / pi)). Eagerly on a CPU the forward
uses ``0.5 (1 + tanh(v)) = sigmoid(2 v)``: gelu(x) = x sigmoid(x (2 k + 2 k 0.044715 x^2)) with
k = sqrt(2 / pi), computed in fp32 over cache-sized chunks (:func:`cpu_tanh_gelu`). PyTorch's CPU tanh
is about 3x slower than its sigmoid, so this forward runs 1.5-1.8x faster. In fp32 the backward keeps
PyTorch's kernel, which is accurate to 1e-6 where the sigmoid form's derivative is not; for 16-bit
tensors (rounded to 2^-8 anyway) the forward also computes the derivative from the same sigmoid and
saves it, and the backward is one multiply (:func:`cpu_bias_tanh_gelu_with_grad`; a call of one
block's size or less runs :func:`bias_gelu_with_grad`'s body whole, the same numbers with fewer operations). SwiGLU splits x into
halves x1, x2 along the last dimension: swiglu = silu(x1) x2, with
d/dx1 = sigmoid(x1)(1 + x1 (1 - sigmoid(x1))) x2 and d/dx2 = silu(x1). Eagerly on a CPU it runs over
cache-sized blocks of rows (:func:`cpu_swiglu`, :func:`cpu_swiglu_back`: the same PyTorch operations
on each block, so the same numbers, each half of the gradient written in place instead of a ``cat``).

Small SwiGLU calls eagerly on a CPU (fewer than ``NATIVE_BELOW`` = 2^16 entries of ``y``) skip the
autograd Function: ``silu(x1) * x2`` under autograd costs one kernel per operation, where the Function's
fixed cost (its Python, and the blocks' extra operations) made the fused call 1.5x slower than the
unfused one at ``[32, 128]``; it also saves ``silu(x1)`` (half of ``x`` more, below 256 KiB in fp32 per
call). The GeLU keeps its Function at every size: a native ``F.gelu`` route for small fp32 calls would save a
few microseconds per call but changes the gradients' last bits, and the tests that hold a zero-bubble
run (ZB-H1 with ZeRO-2) to the 1F1B run's weights bit for bit rely on rounding the two schedules share:
ZB-H1 buckets the deferred weights apart, so its optimizer shards differ from 1F1B's and the gradient
norm (fp32 sums over the shards) can round differently in its last bit (the gradients themselves are
equal; with the norm summed in fp64 the two runs agree to the bit, but fp64 norms cost ~25x on a CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .jit import jit_fuser

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
CPU_CHUNK = 1 << 20  # entries per chunk on a CPU (4 MiB in fp32): the chunk's buffers stay in the cache
NATIVE_BELOW = 1 << 16  # eager on a CPU, fewer entries than this: PyTorch's own kernels under autograd


def _two_v(xf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x (2 k + 2 k 0.044715 x^2)`` of fp32 ``xf`` (2 v, the tanh GeLU's sigmoid argument) in two passes,
    into ``out`` when given."""
    two_k = torch.tensor(2 * SQRT_2_OVER_PI, dtype=torch.float32, device=xf.device)  # addcmul: 2k + 2kc x^2
    return torch.addcmul(two_k, xf, xf, value=2 * SQRT_2_OVER_PI * 0.044715, out=out).mul_(xf)


def cpu_tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """The tanh GeLU of a CPU tensor as ``x sigmoid(x (2 k + 2 k 0.044715 x^2))`` (module docstring),
    computed in fp32 one cache-sized chunk at a time (in ``x``'s logical order) and written, contiguous,
    in ``x``'s dtype."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    flat_x, flat_out = x.reshape(-1), out.view(-1)
    for start in range(0, flat_x.numel(), CPU_CHUNK):
        chunk, target = flat_x[start:start + CPU_CHUNK], flat_out[start:start + CPU_CHUNK]
        xf = chunk.float()  # a copy only when x is 16-bit
        work = target if target.dtype == torch.float32 else torch.empty_like(xf)
        _two_v(xf, out=work).sigmoid_().mul_(xf)
        if work is not target:
            target.copy_(work)
    return out


def _gelu_and_derivative(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gelu(x), gelu'(x))`` of fp32 ``xf`` (new tensors; ``xf`` is left as it is) from one sigmoid
    ``s = sigmoid(x (2 k + 2 k 0.044715 x^2))``: ``gelu(x) = x s``, ``gelu'(x) = s + x s (1 - s) (2 k + 6 k
    0.044715 x^2)``."""
    s = _two_v(xf).sigmoid_()
    two_k = torch.tensor(2 * SQRT_2_OVER_PI, dtype=torch.float32, device=xf.device)
    d = torch.addcmul(two_k, xf, xf, value=6 * SQRT_2_OVER_PI * 0.044715).mul_(xf)  # x d(2v)/dx
    d.mul_(torch.addcmul(s, s, s, value=-1.0)).add_(s)  # x s (1 - s) d(2v)/dx + s
    return s.mul_(xf), d


def cpu_bias_tanh_gelu_with_grad(y: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gelu(x), gelu'(x))`` of ``x = y + bias`` for 16-bit CPU tensors, both in ``y``'s dtype and shape
    (``bias`` broadcasts to ``y``: over the last dimension, or one row per row as the grouped experts pass).

    One pass over cache-sized blocks of rows: ``x`` is rounded to ``y``'s dtype as ``y + bias`` is, then
    both come from one sigmoid in fp32 (:func:`_gelu_and_derivative`). Saving the derivative instead of
    ``x`` makes the backward one multiply, where PyTorch's kernel recomputes a tanh (its CPU tanh costs ~3x
    a sigmoid); the saved derivative is rounded to 16 bits, so the input gradient is rounded twice
    (within 2^-7 of the exact value where PyTorch's kernel is within 2^-8). The same numbers as
    :func:`bias_gelu_with_grad` (element by element the same operations)."""
    hidden = y.shape[-1]
    rows = y.reshape(-1, hidden)
    bias_rows = bias.expand(y.shape).reshape(-1, hidden)  # a view of a [hidden] bias; or one row per row
    out, grad = torch.empty_like(rows), torch.empty_like(rows)
    step = max(1, CPU_CHUNK // hidden)
    for start in range(0, rows.shape[0], step):
        block = slice(start, start + step)
        gelu, derivative = _gelu_and_derivative(torch.add(rows[block], bias_rows[block]).float())
        grad[block].copy_(derivative)
        out[block].copy_(gelu)
    return out.view(y.shape), grad.view(y.shape)


@jit_fuser
def bias_gelu_with_grad(y: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cpu_bias_tanh_gelu_with_grad` in one piece, for a compiled region or ``--jit-fuser compile``."""
    gelu, derivative = _gelu_and_derivative((y + bias).float())
    return gelu.to(y.dtype), derivative.to(y.dtype)


@jit_fuser
def bias_gelu(y: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, gelu(x))`` for ``x = y + bias`` (x is what the backward needs: saved, not recomputed)."""
    x = y + bias
    return x, F.gelu(x, approximate="tanh")  # PyTorch's tanh GeLU: the formula above, one kernel eager


@jit_fuser
def bias_gelu_back(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")  # gelu'(x) * grad


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias):
        ctx.saved_derivative = y.device.type == "cpu" and y.dtype in (torch.bfloat16, torch.float16) and bias.dtype == y.dtype
        if ctx.saved_derivative:  # eagerly in blocks; compiled (a region, --jit-fuser compile) in one piece
            compiled = bias_gelu_with_grad.compiles_for(y, bias)
            if compiled or y.numel() <= CPU_CHUNK:  # one block: the whole, without the blocks' bookkeeping
                out, derivative = bias_gelu_with_grad(y, bias) if compiled else bias_gelu_with_grad.fn(y, bias)
            else:
                out, derivative = cpu_bias_tanh_gelu_with_grad(y, bias)
            ctx.save_for_backward(derivative)
            return out
        if y.device.type == "cpu" and not bias_gelu.compiles_for(y, bias):
            x = y + bias
            out = cpu_tanh_gelu(x)
        else:
            x, out = bias_gelu(y, bias)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        dx = grad * saved if ctx.saved_derivative else bias_gelu_back(grad, saved)
        return dx, dx  # autograd sums the bias's share over the broadcast (token) dimensions


def _runs_eagerly(fused, *args) -> bool:
    """Whether ``fused`` (a ``jit_fuser`` function) would run eagerly on these CPU tensors: not inside a
    compiled region, and not compiled by ``--jit-fuser``."""
    return args[0].is_cpu and not fused.compiles_for(*args)


def bias_gelu_impl(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GeLU of ``y + bias`` (bias over the last dimension, or any shape that broadcasts to
    ``y``'s, e.g. one row per token: the grouped MoE experts' biases)."""
    return _BiasGeLU.apply(y, bias)


@jit_fuser
def swiglu(y: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(y, 2, -1)
    return F.silu(gate) * up


@jit_fuser
def swiglu_back(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(y, 2, -1)  # silu'(gate) = sigmoid(gate) (1 + gate (1 - sigmoid(gate)))
    return torch.cat((torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)), -1)


@jit_fuser
def bias_swiglu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return swiglu(y + bias)


@jit_fuser
def bias_swiglu_back(grad: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return swiglu_back(grad, y + bias)


class _BiasSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias):
        ctx.save_for_backward(y, bias)
        return bias_swiglu(y, bias)

    @staticmethod
    def backward(ctx, grad):
        y, bias = ctx.saved_tensors
        dy = bias_swiglu_back(grad, y, bias)
        return dy, dy


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return swiglu(y)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return swiglu_back(grad, y)


def _swiglu_rows(y: torch.Tensor, bias: torch.Tensor | None):
    """``y`` as rows ``[n, 2 f]``, the bias broadcast to them (or None), and the rows per cache-sized block."""
    width = y.shape[-1]
    rows = y.reshape(-1, width)
    bias_rows = None if bias is None else bias.expand(y.shape).reshape(-1, width)  # a view of a [2 f] bias
    return rows, bias_rows, max(1, CPU_CHUNK // width)


def cpu_swiglu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`swiglu` of ``y + bias`` on a CPU, one cache-sized block of rows at a time: the same operations
    (add, ``silu``, multiply), so the same numbers, without writing ``y + bias`` out whole."""
    rows, bias_rows, step = _swiglu_rows(y, bias)
    half = rows.shape[-1] // 2
    out = torch.empty((rows.shape[0], half), dtype=y.dtype, device=y.device)
    for start in range(0, rows.shape[0], step):
        block = slice(start, start + step)
        x = rows[block] if bias is None else torch.add(rows[block], bias_rows[block])
        target = out[block]
        torch.ops.aten.silu.out(x[:, :half], out=target).mul_(x[:, half:])
    return out.view(*y.shape[:-1], half)


def cpu_swiglu_back(grad: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`swiglu_back` of ``y + bias`` on a CPU, block by block as :func:`cpu_swiglu`, each half of the
    gradient written in place (no ``cat``): the same operations, so the same numbers."""
    rows, bias_rows, step = _swiglu_rows(y, bias)
    half = rows.shape[-1] // 2
    grad_rows = grad.reshape(-1, half)
    dx = torch.empty_like(rows, memory_format=torch.contiguous_format)
    for start in range(0, rows.shape[0], step):
        block = slice(start, start + step)
        x = rows[block] if bias is None else torch.add(rows[block], bias_rows[block])
        gate, up, g = x[:, :half], x[:, half:], grad_rows[block]
        d_gate, d_up = dx[block, :half], dx[block, half:]
        torch.mul(g, up, out=d_gate)
        torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)  # silu'(gate) * grad * up
        torch.ops.aten.silu.out(gate, out=d_up).mul_(g)
    return dx.view(y.shape)


class _CpuSwiGLU(torch.autograd.Function):
    """SwiGLU of ``y + bias`` (bias optional) eagerly on a CPU: saves ``y`` (and the bias), as the others."""

    @staticmethod
    def forward(ctx, y, bias):
        ctx.save_for_backward(y, bias)
        return cpu_swiglu(y, bias)

    @staticmethod
    def backward(ctx, grad):
        y, bias = ctx.saved_tensors
        dy = cpu_swiglu_back(grad, y, bias)
        return dy, None if bias is None else dy


def bias_swiglu_impl(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(x1) * x2`` of ``x = y + bias`` split in halves along the last dimension (bias optional).
    Eager on a CPU: PyTorch's own kernels under autograd below ``NATIVE_BELOW`` entries, else
    :class:`_CpuSwiGLU` (module docstring)."""
    if (bias is None or bias.dtype == y.dtype) and _runs_eagerly(swiglu if bias is None else bias_swiglu, y,
                                                                     *([] if bias is None else [bias])):
        if y.numel() < NATIVE_BELOW:
            gate, up = (y if bias is None else y + bias).chunk(2, -1)
            return F.silu(gate) * up
        return _CpuSwiGLU.apply(y, bias)
    return _SwiGLU.apply(y) if bias is None else _BiasSwiGLU.apply(y, bias)


def bias_activation_impl(y: torch.Tensor, bias: torch.Tensor | None, swiglu: bool) -> torch.Tensor:
    """The fused bias + activation of an MLP (dense, shared or routed experts): SwiGLU or tanh GeLU."""
    return bias_swiglu_impl(y, bias) if swiglu else bias_gelu_impl(y, bias)
