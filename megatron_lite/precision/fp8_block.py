"""Block-scaled FP8: the ``blockwise`` (DeepSeek-V3 style) and ``mxfp8`` (OCP microscaling) recipes.

Both are current scaling with one scale per block of values instead of one per tensor, so an
outlier only coarsens the values of its own block. Every scale comes from the block being cast
right now: no amax history, no reduction over any group (a block's scale is local to it).

No parallel layout needs one. Tensor parallelism shards weights into whole blocks when the shard
sizes are multiples of the block (a boundary inside a block gives two blocks, close, not the same);
sequence parallelism all-gathers the sequence before every GEMM. Context parallelism (and an MoE
expert's share of tokens) changes which tokens form wgrad's token blocks, the only blocks that run
along tokens: the forward's and dgrad's blocks hold one token's values each. But the scales are powers
of two, which shift exponents without changing FP8's relative rounding, so a value is cast the same
under any block's scale unless it falls into that block's subnormal range or saturates (it cannot
saturate: the scale keeps the block's amax in range). CP2 runs therefore equal one process to 1e-5
(tests/distributed/test_fp8_context_parallel.py), unlike tensorwise scaling, whose fp32 scale of a
different amax rounds every value differently and so is MAX-reduced over TP x CP.

* ``blockwise`` (Transformer Engine's ``Float8BlockScaling``): activations and output gradients in
  1 x 128 blocks along the GEMM's reduction dimension, weights in 128 x 128 blocks; each block's
  scale is ``fp8_max / amax`` rounded *down* to a power of two (TE's default), kept as fp32; an
  all-zero (or non-finite) block gets scale 1.
* ``mxfp8`` (``MXFP8BlockScaling``): every operand in 1 x 32 blocks along the reduction dimension.
  A block's dequantisation factor is ``2^ceil(log2(amax / fp8_max))``, an E8M0 power of two
  (exponent -127..127; an all-zero block gets 2^-127, as TE's ``float_to_e8m0``).

The reduction dimension differs between the three GEMMs of a linear ``Y = X W^T``: it is the input
features for the forward, the output features for dgrad ``dX = dY W`` and the tokens for wgrad
``dW = dY^T X``, so each GEMM gets its own quantisation of its operands, all made from the
high-precision tensors (never re-quantised from another FP8 copy). A 128 x 128 weight block covers
the same values either way, so ``blockwise`` reuses the forward's weight for dgrad.

A dimension that is not a multiple of the block size ends in a partial block: the same scales and
values as zero-padding it to the next multiple (zeros change no amax and add nothing to a GEMM).
Transformer Engine refuses such shapes instead; here they keep tiny models and any MoE token count
working.

The GEMMs run as dequantised matmuls: every FP8 value times a power-of-two scale is exact in bf16
and fp32, so widening both operands and multiplying with fp32 accumulation gives the block-scaled
product up to summation order (bf16 on a CPU whose bf16 GEMM is faster, for bf16 results, as
:func:`~megatron_lite.precision.fp8_ops.cpu_compute_dtype`; fp32 otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .fp8_ops import E4M3, FP8_MAX, GEMM_ALIGNMENT, cpu_compute_dtype, widen

BLOCK_SIZE = {"blockwise": 128, "mxfp8": 32}
BLOCK_RECIPES = tuple(BLOCK_SIZE)
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
POW2_FOR_INF = 2.0**127  # a scale that overflows fp32 (tiny amax): the largest power of two


def token_alignment(recipe: str) -> int:
    """The multiple of tokens an FP8 GEMM of ``recipe`` wants in its token dimension (the reduction
    dimension of the weight gradient), which ``--moe-router-padding-for-fp8`` pads every expert to:
    the block size for ``blockwise`` (128) and ``mxfp8`` (32), so no token block is partial; 16
    for ``delayed`` and ``tensorwise`` (``torch._scaled_mm``'s alignment, which the weight-gradient
    GEMM otherwise reaches by appending zero rows)."""
    return BLOCK_SIZE.get(recipe, GEMM_ALIGNMENT)


def pow2_block_scale(block_amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``blockwise`` scales: ``fp8_max / amax`` rounded down to a power of two (1 for an amax that is
    0, inf or NaN; 2^127 where the quotient overflows)."""
    amax = block_amax.float()
    scale = fp8_max / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, POW2_FOR_INF), scale)
    usable = torch.isfinite(amax) & (amax > 0)
    _, exp = torch.frexp(torch.where(usable, scale, torch.ones_like(scale)))  # scale = m * 2^exp, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(scale), exp - 1)


def e8m0_exponent(block_amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``mxfp8``: the unbiased E8M0 exponent ``ceil(log2(amax / fp8_max))`` clamped to -127..127, as
    int32 (-127 for an all-zero block; 127 for inf). A NaN amax gives 127 too: the NaN stays in the data."""
    ratio = block_amax.float() / fp8_max
    mant, exp = torch.frexp(ratio)  # ratio = mant * 2^exp: ceil(log2) is exp, or exp - 1 at mant == 0.5
    ceil_log2 = torch.where(mant == 0.5, exp - 1, exp)
    ceil_log2 = torch.where(ratio > 0, ceil_log2, torch.full_like(ceil_log2, E8M0_MIN_EXP))
    ceil_log2 = torch.where(torch.isfinite(ratio), ceil_log2, torch.full_like(ceil_log2, E8M0_MAX_EXP))
    return ceil_log2.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


@dataclass
class BlockFp8:
    """An FP8 matrix with one dequantisation factor per block: ``value = data * scale_inv[block]``.

    ``data`` [R, C] FP8; ``scale_inv`` [ceil(R / block[0]), ceil(C / block[1])] fp32 (powers of two)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    wide: dict | None = field(default=None, repr=False, compare=False)
    """dtype -> :meth:`dequantize` result, kept (a cached weight's: the same values all step); None: not kept."""

    def t(self) -> BlockFp8:
        return BlockFp8(self.data.t(), self.scale_inv.t(), (self.block[1], self.block[0]))

    def e8m0(self) -> torch.Tensor:
        """The scales as E8M0 bytes (``torch.float8_e8m0fnu``: exact, every scale is a power of two)."""
        return self.scale_inv.to(torch.float8_e8m0fnu)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values in ``dtype`` (exact in fp32 and bf16); kept in :attr:`wide` when it is a dict."""
        if self.wide is not None and dtype in self.wide:
            return self.wide[dtype]
        rows, cols = self.data.shape
        (br, bc), wide = self.block, _padded(widen(self.data, torch.float32), *self.block)
        tiles = wide.view(wide.shape[0] // br, br, wide.shape[1] // bc, bc).mul_(self.scale_inv[:, None, :, None])
        values = tiles.to(dtype).reshape(wide.shape)[:rows, :cols]
        if self.wide is not None:
            self.wide[dtype] = values
        return values


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pad_r, pad_c = -x.shape[0] % rows, -x.shape[1] % cols
    return torch.nn.functional.pad(x, (0, pad_c, 0, pad_r)) if pad_r or pad_c else x


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], recipe: str, dtype: torch.dtype = E4M3) -> BlockFp8:
    """``x`` [R, C] cast to ``dtype`` with one scale per ``block`` (``(1, b)``: along rows, ``(b, b)``:
    tiles), the scale rule of ``recipe`` (``blockwise``/``mxfp8``). Saturating (clamped) cast, in fp32."""
    rows, cols = x.shape
    br, bc = block
    xp = _padded(x.detach().float(), br, bc)
    tiles = xp.view(xp.shape[0] // br, br, xp.shape[1] // bc, bc)
    block_amax = tiles.abs().amax(dim=(1, 3))
    limit = FP8_MAX[dtype]
    if recipe == "mxfp8":
        exp = e8m0_exponent(block_amax, limit)
        one = torch.ones_like(block_amax)
        scale, scale_inv = torch.ldexp(one, -exp), torch.ldexp(one, exp)
    else:
        scale = pow2_block_scale(block_amax, limit)
        scale_inv = scale.reciprocal()  # exact: a power of two
    q = (tiles * scale[:, None, :, None]).clamp_(-limit, limit).to(dtype)
    return BlockFp8(q.reshape(xp.shape)[:rows, :cols], scale_inv, block)


def _compute_dtype(device: torch.device, out_dtype: torch.dtype) -> torch.dtype:
    if device.type == "cpu":
        return cpu_compute_dtype(out_dtype)
    return torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32


def block_matmul(a: BlockFp8, b: BlockFp8, out_dtype: torch.dtype, b_transposed: bool = False) -> torch.Tensor:
    """``dequant(a) @ dequant(b)`` (``dequant(b)^T`` with ``b_transposed``) with fp32 accumulation, in
    ``out_dtype`` (module docstring)."""
    compute = _compute_dtype(a.data.device, out_dtype)
    wide_b = b.dequantize(compute)
    return (a.dequantize(compute) @ (wide_b.t() if b_transposed else wide_b)).to(out_dtype)


def _rows(x: torch.Tensor, size: int, recipe: str, dtype: torch.dtype) -> BlockFp8:
    """``x`` with blocks along its last dimension (1 x size)."""
    return quantize_blocks(x, (1, size), recipe, dtype)


def _cols(x: torch.Tensor, size: int, recipe: str, dtype: torch.dtype) -> BlockFp8:
    """``x`` with blocks along its first dimension (size x 1), quantised from ``x`` itself."""
    return quantize_blocks(x.t(), (1, size), recipe, dtype).t()


def _pack(q: BlockFp8) -> tuple[torch.Tensor, torch.Tensor]:
    return q.data, q.scale_inv


def weight_blocks(gemm, weight: torch.Tensor, record: bool) -> tuple[BlockFp8, BlockFp8]:
    """The quantised weight for the forward GEMM and for dgrad (the same object for ``blockwise``, whose
    128 x 128 tiles serve both). Training calls (``record``) keep them in ``gemm``'s weight cache for the
    rest of the step, with their dequantised forms, as the delayed recipe keeps its E4M3 weight
    (:meth:`~megatron_lite.precision.fp8.Fp8Gemm._cached_weight`): the weight and its block scales are
    fixed until the optimizer writes it, so every later micro-batch (and a recomputed forward) reuses
    them. The once-per-step :func:`~megatron_lite.precision.fp8.update_fp8_scales` (before the optimizer
    writes the weights, which through a flat parameter buffer bumps no tensor version) drops it, and it
    is keyed on the weight tensor's storage, layout and version, so an in-place write or a checkpoint
    load quantises again too; ``drop_weight_cache`` (ZeRO-3) and a dtype or device cast drop it.
    Evaluation (no grad) quantises per call and keeps nothing."""
    cache = gemm._weight_fp8
    key = gemm._weight_key(weight) if record else None
    if record and cache is not None and cache["key"] == key and "blocks" in cache:
        return cache["blocks"]
    name = gemm.recipe.recipe
    size = BLOCK_SIZE[name]
    if name == "blockwise":
        wq = quantize_blocks(weight, (size, size), name, E4M3)
        w_dgrad = wq
    else:  # mxfp8: along the input features (forward), along the output features (dgrad's reduction)
        wq, w_dgrad = _rows(weight, size, name, E4M3), _cols(weight, size, name, E4M3)
    if record:
        for q in {id(wq): wq, id(w_dgrad): w_dgrad}.values():
            q.wide = {}
        gemm._weight_fp8 = {"key": key, "blocks": (wq, w_dgrad)}
    return wq, w_dgrad


class BlockFp8LinearFunction(torch.autograd.Function):
    """``x @ weight.T + bias`` with the forward, dgrad and wgrad GEMMs block-scaled (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemm, record=False):
        recipe = gemm.recipe
        size, name = BLOCK_SIZE[recipe.recipe], recipe.recipe
        x2 = x.reshape(-1, x.shape[-1])
        xq = _rows(x2, size, name, E4M3)  # along the input features (the forward's reduction dimension)
        wq, w_dgrad = weight_blocks(gemm, weight, record)
        out = block_matmul(xq, wq, x.dtype, b_transposed=True)
        if bias is not None:
            out = out + bias
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        if not any(ctx.needs_input_grad):  # evaluation: no operands for backward GEMMs
            return out
        if recipe.wgrad:  # along the tokens (wgrad's reduction dimension)
            ctx.save_for_backward(*_pack(_cols(x2, size, name, E4M3)))
        else:
            ctx.save_for_backward(x2.detach(), torch.empty(0))
        ctx.gemm, ctx.x_shape, ctx.x_dtype = gemm, x.shape, x.dtype
        ctx.w_dtype, ctx.b_dtype, ctx.size = weight.dtype, None if bias is None else bias.dtype, size
        ctx.w_dgrad = w_dgrad  # (kept whole: a cached weight's dequantised form comes with it)
        return out

    @staticmethod
    def backward(ctx, dy):
        x_data, x_scale = ctx.saved_tensors
        recipe, size = ctx.gemm.recipe, ctx.size
        name, gdtype = recipe.recipe, recipe.grad_dtype
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = block_matmul(_rows(dy2, size, name, gdtype), ctx.w_dgrad, ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if recipe.wgrad:
                x_wgrad = BlockFp8(x_data, x_scale, (size, 1))
                dw = block_matmul(_cols(dy2, size, name, gdtype).t(), x_wgrad, ctx.w_dtype)
            else:  # high-precision wgrad from the unquantised gradient and input
                dw = (dy2.to(x_data.dtype).t() @ x_data).to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None


def describe_block_recipe(recipe: str) -> str:
    """The startup log's words for a block-scaled recipe."""
    if recipe == "blockwise":
        return ("blockwise scaling (1x128 blocks for inputs and gradients, 128x128 for weights, "
                "power-of-two fp32 scales, no history)")
    return "mxfp8 scaling (1x32 blocks along each GEMM's reduction dimension, E8M0 scales, no history)"
