"""FP8 training in plain PyTorch: the recipe, an FP8 linear GEMM and its per-step scale update.

:class:`Fp8Gemm` plugs into the GEMM seam of the tensor-parallel linears (``gemm(x, weight, bias)``
computes ``x @ weight.T + bias`` on this rank's shard). Each call quantises

* forward: input and weight to E4M3 and runs the FP8 GEMM;
* backward: the output gradient to E5M2 (``hybrid``) or E4M3 (``e4m3``), then dgrad ``dY @ W`` in
  FP8, and wgrad ``dY^T @ X`` in FP8 too unless ``wgrad=False`` (then in the input's precision).

The FP8 GEMM is ``torch._scaled_mm`` on GPUs and an exact dequantised GEMM on CPUs, where
``_scaled_mm`` is a slow emulation (:func:`~megatron_lite.precision.fp8_ops.fp8_gemm_path`). Outputs,
the bias add and everything outside the GEMM stay in high precision.

Recipes:

* ``delayed``: each tensor slot (input, weight, output gradient) uses the scale computed at the
  previous step's update; calls only record their amax (max over the micro-batches of a step).
  :func:`update_fp8_scales`, called once per optimizer step, MAX-reduces the recorded amaxes over
  each gemm's ``amax_group``, then per slot computes the amax from an ``amax_history_len`` long
  history (``most_recent`` or ``max``), ``scale = (fp8_max / amax) / 2^margin`` and rolls the
  history. The histories and scales are buffers, so they are saved in checkpoints and a resumed
  run continues with the same scales.
* ``tensorwise``: each call scales by ``fp8_max / amax`` of the tensor it casts, the amaxes
  MAX-reduced over ``amax_group`` first.
* ``blockwise`` and ``mxfp8``: one scale per block of values (:mod:`~megatron_lite.precision.fp8_block`),
  from that block alone: no history, no reduction.

``amax_group`` is the group whose ranks together hold the tensor one process would cast: the
tensor x context parallel group (``tp_cp``) for the dense layers, whose weights are sharded over TP
and whose GEMMs see only their CP rank's chunks of the sequence (sequence parallelism all-gathers
the sequence before a GEMM, so TP covers it), and ``expert_amax`` for the experts. Then every shard
of a tensor gets the same scale, so the sharded GEMMs compute exactly what the unsharded FP8 GEMM
would (up to summation order); over TP only, tensorwise scaling would cast each CP rank's half of
the sequence with its own scale. Delayed scaling's update reduces over ``amax_group`` and then over
the data-parallel x CP replicas.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from .fp8_block import BLOCK_RECIPES, BlockFp8LinearFunction, describe_block_recipe
from .fp8_ops import (
    E4M3,
    E5M2,
    FP8_MAX,
    GEMM_ALIGNMENT,
    SCALED_MM,
    amax,
    amax_from_history,
    column_major,
    cpu_compute_dtype,
    current_scale,
    delayed_scale,
    fp8_gemm_path,
    fp8_matmul,
    pad_rows,
    quantize,
    roll_amax_history,
    widen,
)

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise") + BLOCK_RECIPES
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
MAX_MARGIN = 17  # largest |--fp8-margin|: 2^18 exceeds E4M3's range (448 / 2^-9, ~2^17.8)
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2  # columns of the amax history / entries of the scale buffer


@dataclass(frozen=True)
class Fp8Recipe:
    """What to quantise how. Field defaults are Megatron's flag defaults (format aside)."""

    format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True

    def __post_init__(self):
        if self.format not in FP8_FORMATS:
            raise ConfigError(f"--fp8-format {self.format}: expected one of {', '.join(FP8_FORMATS)}")
        if self.recipe not in FP8_RECIPES:
            raise ConfigError(f"--fp8-recipe {self.recipe}: expected one of {', '.join(FP8_RECIPES)}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ConfigError(f"--fp8-amax-compute-algo {self.amax_compute_algo}: "
                              f"expected one of {', '.join(AMAX_COMPUTE_ALGOS)}")
        if self.amax_history_len < 1:
            raise ConfigError(f"--fp8-amax-history-len {self.amax_history_len} must be at least 1")
        if abs(self.margin) > MAX_MARGIN:
            raise ConfigError(f"--fp8-margin {self.margin} must be between -{MAX_MARGIN} and {MAX_MARGIN} (2^{abs(self.margin)} "
                              "exceeds E4M3's range 448 / 2^-9: every value would quantise to 0 or saturate); use 0")

    @property
    def grad_dtype(self) -> torch.dtype:
        """FP8 dtype of the output gradient: E5M2 (more range) in hybrid, E4M3 in e4m3."""
        return E5M2 if self.format == "hybrid" else E4M3

    def fp8_max(self) -> torch.Tensor:
        """Largest finite value per slot (input, weight, output gradient)."""
        return torch.tensor([FP8_MAX[E4M3], FP8_MAX[E4M3], FP8_MAX[self.grad_dtype]])

    def describe(self) -> str:
        grads = "E5M2" if self.format == "hybrid" else "E4M3"
        if self.recipe == "delayed":
            how = (f"delayed scaling (amax history {self.amax_history_len}, {self.amax_compute_algo}, "
                   f"margin {self.margin})")
        elif self.recipe in BLOCK_RECIPES:
            how = describe_block_recipe(self.recipe)
        else:
            how = "tensorwise (current) scaling"
        wgrad = "FP8 wgrad" if self.wgrad else "bf16 wgrad"
        return f"{self.format} (E4M3 forward, {grads} gradients), {how}, {wgrad}"


class _Fp8LinearFunction(torch.autograd.Function):
    """``x @ weight.T + bias`` with the three GEMMs in FP8 (``torch._scaled_mm`` has no autograd)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemm, record):
        x2 = x.reshape(-1, x.shape[-1])
        cached = gemm._cached_weight(weight) if record else None
        x_amax, w_amax = amax(x2), None if cached is not None else amax(weight)
        scale = gemm._forward_scales(x_amax, w_amax, record)
        # one fresh tensor per slot: the GPU kernel takes a scale only at an aligned address
        inv_x, inv_w = scale[INPUT].reciprocal(), scale[WEIGHT].reciprocal()
        x8 = quantize(x2, scale[INPUT], E4M3, x_amax)
        if cached is None:
            # (contiguous: an expert's weight may arrive as a transposed view of a stacked tensor)
            w8 = quantize(weight, scale[WEIGHT], E4M3, w_amax).contiguous()
            if record:
                gemm._keep_weight(weight, w8)
        else:
            w8 = cached
        out = gemm._matmul("fprop", x8, gemm._weight_operand(w8, "fprop", x.dtype), inv_x, inv_w, x.dtype)
        if bias is not None:
            out = out + bias
        # FP8 copies are what the backward GEMMs need (and 1 byte per element to keep)
        ctx.save_for_backward(x8 if gemm.recipe.wgrad else x2.detach(), w8, inv_x, inv_w)
        ctx.gemm, ctx.x_shape, ctx.x_dtype = gemm, x.shape, x.dtype
        ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x_saved, w8, inv_x, inv_w = ctx.saved_tensors
        gemm = ctx.gemm
        dy2 = dy.reshape(-1, dy.shape[-1])
        g_amax = amax(dy2)
        g_scale = gemm._grad_scale(g_amax)
        g_inv = g_scale.reciprocal()
        dy8 = quantize(dy2, g_scale, gemm.recipe.grad_dtype, g_amax)
        dx = dw = db = None
        kernel = fp8_gemm_path(dy.device) == SCALED_MM  # operands in its layout; a CPU GEMM takes views
        if not kernel:  # widened once for both GEMMs (exact: every FP8 value is a bf16 and an fp32 value)
            dy8 = widen(dy8, cpu_compute_dtype(ctx.x_dtype))
        if ctx.needs_input_grad[0]:
            dx = gemm._matmul("dgrad", dy8, gemm._weight_operand(w8, "dgrad", ctx.x_dtype), g_inv, inv_w, ctx.x_dtype)
            dx = dx.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if gemm.recipe.wgrad:
                a, b = dy8.t(), x_saved
                if kernel:  # (the token dimension is the inner one here: zero rows pad it to the alignment)
                    a, b = pad_rows(dy8, GEMM_ALIGNMENT).t().contiguous(), column_major(pad_rows(x_saved, GEMM_ALIGNMENT))
                dw = gemm._matmul("wgrad", a, b, g_inv, inv_x, ctx.w_dtype)
            else:  # high-precision wgrad from the unquantised gradient and input
                dw = (dy2.to(x_saved.dtype).t() @ x_saved).to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.b_dtype)  # fp32 sums, no fp32 copy of dy
        return dx, dw, db, None, None


class Fp8Gemm(nn.Module):
    """The FP8 GEMM of one linear layer: ``gemm(x, weight, bias=None) -> x @ weight.T + bias``.

    Holds the FP8 state of that layer as buffers (so it is checkpointed): ``amax_history``
    ``[amax_history_len, 3]`` and ``scale [3]``, columns (input, weight, output gradient).
    ``amax_group``: process group over which amaxes are MAX-reduced (None: this process only).
    ``expert``: the gemm of an MoE expert, whose weight exists on one expert-parallel rank only;
    the per-step update reduces its amaxes over the expert-data-parallel group instead of the
    data-parallel group (reducing over expert parallelism would mix different experts' amaxes).
    ``fallbacks`` maps a GEMM (``fprop``/``dgrad``/``wgrad``) that could not use the FP8 kernel to
    the reason; it then ran as a dequantised matmul on the same FP8 values.
    """

    def __init__(self, recipe: Fp8Recipe, amax_group=None, expert: bool = False):
        super().__init__()
        self.recipe = recipe
        self.amax_group = amax_group
        self.expert = expert
        self.register_buffer("amax_history", torch.zeros(recipe.amax_history_len, 3))
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("fp8_max", recipe.fp8_max(), persistent=False)
        self.fallbacks: dict[str, str] = {}
        self._weight_fp8: dict | None = None  # this step's quantised weight (see _cached_weight)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.recipe.recipe in BLOCK_RECIPES:  # per-block current scaling: no state, no reduction
            return BlockFp8LinearFunction.apply(x, weight, bias, self, torch.is_grad_enabled())
        # delayed scaling learns from training passes only: evaluation (no grad) leaves no trace
        return _Fp8LinearFunction.apply(x, weight, bias, self, torch.is_grad_enabled())

    def extra_repr(self) -> str:
        return self.recipe.describe()

    def _apply(self, fn, recurse=True):
        # FP8 bookkeeping stays fp32 when the model is cast (e.g. to bf16): scales need the range
        super()._apply(fn, recurse)
        self._weight_fp8 = None
        for name in ("amax_history", "scale", "fp8_max"):
            buf = getattr(self, name)
            if buf.dtype != torch.float32:
                setattr(self, name, buf.float())
        return self

    def _reduce(self, amaxes: torch.Tensor) -> torch.Tensor:
        if self.amax_group is not None and dist.get_world_size(self.amax_group) > 1:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=self.amax_group)
        return amaxes

    def _forward_scales(self, x_amax: torch.Tensor, w_amax: torch.Tensor | None, record: bool) -> torch.Tensor:
        """Scales for (input, weight) of this call from their amaxes, which it records for delayed
        scaling (the input's only when ``w_amax`` is None: a cached weight's amax is already recorded
        this step)."""
        if w_amax is None:
            if record:
                seen = self.amax_history[0, INPUT]
                torch.maximum(seen, x_amax.to(self.scale.device), out=seen)
            return self.scale[:2]
        amaxes = torch.stack([x_amax, w_amax]).to(self.scale.device)
        if self.recipe.recipe == "tensorwise":
            return current_scale(self._reduce(amaxes), self.fp8_max[:2])
        if record:
            seen = self.amax_history[0, :2]
            torch.maximum(seen, amaxes, out=seen)
        return self.scale[:2]  # (read at once: the per-step update is the only writer)

    def _weight_key(self, weight: torch.Tensor) -> tuple:
        return weight.data_ptr(), weight._version, weight.shape, weight.stride(), weight.dtype, self.scale._version

    def _cached_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The E4M3 weight quantised by an earlier training call of this step, if ``weight`` is unchanged.

        With delayed scaling the weight and its scale are fixed within an optimizer step, so the
        first micro-batch quantises the weight (and records its amax) and the others reuse it, with
        its column-major copy for dgrad. :meth:`update_scales` (once per step) drops it, and so does
        any change of the weight tensor (another storage, an in-place write). Tensorwise scaling
        reduces amaxes over ``amax_group`` on every call, so it never caches."""
        cache = self._weight_fp8
        if self.recipe.recipe != "delayed" or cache is None or cache["key"] != self._weight_key(weight):
            return None
        return cache["w8"]

    def _keep_weight(self, weight: torch.Tensor, w8: torch.Tensor) -> None:
        if self.recipe.recipe == "delayed":
            self._weight_fp8 = {"key": self._weight_key(weight), "w8": w8, "operand": None}

    def drop_weight_cache(self) -> None:
        """Forget the cached quantised weight (:meth:`_cached_weight`); the next training call quantises
        the weight again. ZeRO-3 calls it when it frees the weight's unit: the cache is a full-size
        copy of the weight (and, for dgrad, a second one), which would undo the parameter sharding."""
        self._weight_fp8 = None

    def _weight_operand(self, w8: torch.Tensor, kind: str, out_dtype: torch.dtype) -> torch.Tensor:
        """The weight operand of the ``fprop`` (``W^T``) or ``dgrad`` (``W``) GEMM. For the FP8 kernel
        dgrad needs ``w8`` column-major; a CPU's dequantised GEMM takes ``w8`` widened (exactly) to the dtype
        it computes ``out_dtype`` results in. Either is made once per step for the cached weight
        (:meth:`_cached_weight`)."""
        kernel = fp8_gemm_path(w8.device) == SCALED_MM
        if kernel and kind == "fprop":
            return w8.t()
        make = column_major if kernel else (lambda t: widen(t, cpu_compute_dtype(out_dtype)))
        cache = self._weight_fp8
        if cache is None or cache["w8"] is not w8:
            operand = make(w8)
        else:
            if cache["operand"] is None:
                cache["operand"] = make(w8)
            operand = cache["operand"]
        return operand.t() if kind == "fprop" else operand

    def _grad_scale(self, dy_amax: torch.Tensor) -> torch.Tensor:
        """Scale for the output gradient of this call from its amax, which it records for delayed scaling."""
        g = dy_amax.to(self.scale.device).reshape(1)
        if self.recipe.recipe == "tensorwise":
            return current_scale(self._reduce(g), self.fp8_max[GRAD_OUTPUT:])[0]
        seen = self.amax_history[0, GRAD_OUTPUT:]
        torch.maximum(seen, g, out=seen)
        return self.scale[GRAD_OUTPUT]

    def _matmul(self, kind, a, b, a_scale_inv, b_scale_inv, out_dtype):
        out, reason = fp8_matmul(a, b, a_scale_inv, b_scale_inv, out_dtype)
        if reason is not None and kind not in self.fallbacks:
            self.fallbacks[kind] = reason
            warnings.warn(f"FP8 {kind} GEMM {tuple(a.shape)} x {tuple(b.shape)} runs as a dequantised "
                          f"matmul: {reason}", stacklevel=2)
        return out

    @torch.no_grad()
    def update_scales(self, reduced_amax: torch.Tensor | None = None) -> None:
        """Delayed scaling's once-per-step update (a no-op for tensorwise scaling).

        ``reduced_amax`` replaces the latest history row (the amaxes recorded this step) when it
        has already been MAX-reduced over ``amax_group``; :func:`update_fp8_scales` does that for
        all gemms of a model with one collective per group.
        """
        if self.recipe.recipe != "delayed":
            return
        self._weight_fp8 = None  # the next step's weight and scale differ
        if reduced_amax is not None:
            self.amax_history[0] = reduced_amax
        latest = amax_from_history(self.amax_history, self.recipe.amax_compute_algo)
        self.scale.copy_(delayed_scale(latest, self.scale, self.fp8_max, self.recipe.margin))
        self.amax_history.copy_(roll_amax_history(self.amax_history))


def fp8_gemms(modules: nn.Module | Iterable[nn.Module]) -> list[Fp8Gemm]:
    """Every :class:`Fp8Gemm` inside ``modules`` (a model or a list of model chunks), in order."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    return [m for module in modules for m in module.modules() if isinstance(m, Fp8Gemm)]


@torch.no_grad()
def update_fp8_scales(modules: nn.Module | Iterable[nn.Module], data_parallel_group=None,
                      expert_data_parallel_group=None) -> int:
    """The once-per-step delayed-scaling update of every FP8 gemm in ``modules``.

    The amaxes recorded this step are MAX-reduced with one all-reduce per ``amax_group`` (all ranks
    of a group hold the same gemms in the same order) and then once more over the replicas: the
    dense gemms over ``data_parallel_group``, the experts' gemms (``expert=True``) over
    ``expert_data_parallel_group`` (the ranks holding the same experts), so every replica derives
    the same scales from the whole global batch. An expert that received no token anywhere
    records an input/gradient amax of 0, which keeps its previous scale. Then each gemm updates
    its scales and history. Call on every rank after the last backward of the step. Returns the
    number of gemms updated.
    """
    gemms = fp8_gemms(modules)
    for g in gemms:  # every recipe's weight cache of this step: the optimizer writes the weights next
        g.drop_weight_cache()
    delayed = [g for g in gemms if g.recipe.recipe == "delayed"]
    if not delayed:
        return 0
    latest = torch.stack([g.amax_history[0] for g in delayed])
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(delayed):
        by_group.setdefault(id(g.amax_group), []).append(i)
    for rows in by_group.values():
        _all_reduce_max_rows(latest, rows, delayed[rows[0]].amax_group)
    for expert, group in ((False, data_parallel_group), (True, expert_data_parallel_group)):
        _all_reduce_max_rows(latest, [i for i, g in enumerate(delayed) if g.expert == expert], group)
    for g, row in zip(delayed, latest):
        g.update_scales(row)
    return len(delayed)


def _all_reduce_max_rows(table: torch.Tensor, rows: list[int], group) -> None:
    """MAX-reduce ``table[rows]`` over ``group`` in place (nothing for no rows or a one-rank group)."""
    if rows and group is not None and dist.get_world_size(group) > 1:
        part = table[rows]
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
        table[rows] = part


def is_fp8_state_key(name: str) -> bool:
    """True for a state-dict entry that is FP8 bookkeeping (amax history, scale), not a weight."""
    return name.endswith((".gemm.amax_history", ".gemm.scale"))
