"""Small pieces shared by the transformer models: seeded init, normalisation, rotary embeddings.

Seeded init: every parameter's full ("master") weight is drawn from its own generator, seeded by
``(seed, global layer number, parameter name)`` (see ``TransformerConfig.init_method``). Layer 0 is
the embedding, layers 1..L are the transformer layers, L + 1 the output layer. A model split over
any tensor-parallel size or any pipeline layer range therefore holds exactly the slices of the
single-process weights.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear


def param_seed(seed: int, layer_number: int, name: str) -> int:
    """A 63-bit seed derived from (seed, layer number, parameter name); stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}/{layer_number}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def param_generator(seed: int, layer_number: int, name: str) -> torch.Generator:
    """The CPU generator that draws one parameter's full master weight."""
    return torch.Generator().manual_seed(param_seed(seed, layer_number, name))


def column_linear(config, state, layer_number: int, output_size: int, name: str, stride: int = 1, *,
                  input_size: int | None = None, bias: bool | None = None, skip_bias_add: bool = False):
    """The hidden (or ``input_size``) -> ``output_size`` ColumnParallelLinear called ``name`` in global
    layer ``layer_number``: seeded init, the config's bias (unless ``bias`` is given), sequence
    parallelism, dtype, GEMM and gradient-accumulation fusion."""
    return ColumnParallelLinear(
        input_size or config.hidden_size, output_size, state.tp_group,
        bias=config.add_bias_linear if bias is None else bias,
        init_method=config.init_method(layer_number, f"{name}.weight"), sequence_parallel=config.sequence_parallel,
        stride=stride, gemm=config.make_gemm(layer_number, state.group("tp_cp")), dtype=config.params_dtype,
        skip_bias_add=skip_bias_add, gradient_accumulation_fusion=config.gradient_accumulation_fusion,
    )


def row_linear(config, state, layer_number: int, input_size: int, name: str, skip_bias_add: bool = False):
    """The ``input_size`` -> hidden RowParallelLinear (an output projection: Megatron's scaled init)."""
    return RowParallelLinear(
        input_size, config.hidden_size, state.tp_group, bias=config.add_bias_linear, input_is_parallel=True,
        init_method=config.init_method(layer_number, f"{name}.weight", scaled=True),
        sequence_parallel=config.sequence_parallel, gemm=config.make_gemm(layer_number, state.group("tp_cp")),
        dtype=config.params_dtype, skip_bias_add=skip_bias_add,
        gradient_accumulation_fusion=config.gradient_accumulation_fusion,
    )


def init_replicated(param: nn.Parameter, init_method) -> None:
    """Fill a replicated (not tensor-parallel) parameter from its full master weight."""
    master = torch.empty(param.shape, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        param.copy_(master)


def in_dtype(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``x`` in ``dtype`` (itself when it already is, or when ``dtype`` is None): a spec's own norm given
    ``--fp32-residual-connection``'s fp32 stream may return fp32, which the 16-bit layers after it cannot take."""
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def residual_compute_dtype(config) -> torch.dtype | None:
    """The dtype a norm's output is cast to under ``--fp32-residual-connection`` (the model's), else None:
    nothing is cast, so a model built in fp32 and moved with ``.to(torch.bfloat16)`` runs in bf16."""
    return config.params_dtype if config.fp32_residual_connection else None


class Norm(nn.Module):
    """LayerNorm (weight + bias) or RMSNorm (weight only) over the last dim.

    ``zero_centered`` (``--apply-layernorm-1p``): the stored weight ``w`` starts at 0 and the norm
    scales by ``1 + w``, so the same function as the plain norm with weight ``1 + w``.

    Replicated over tensor-parallel ranks. Under sequence parallelism each rank normalises only
    its sequence shard, so its weight gradient is partial: the parameters carry
    ``sequence_parallel = True`` and the training code sums their gradients over TP.

    An fp32 input to 16-bit weights (``--fp32-residual-connection``'s stream) is normalised in fp32 and
    returned in the weights' dtype, the layers' compute dtype.
    """

    def __init__(self, hidden_size: int, kind: str = "LayerNorm", eps: float = 1e-5, *,
                 sequence_parallel: bool = False, dtype=torch.float32, device=None, zero_centered: bool = False):
        super().__init__()
        self.kind, self.eps, self.hidden_size, self.zero_centered = kind, eps, hidden_size, zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype, device=device))
        self.weight.sequence_parallel = sequence_parallel
        if kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_config(cls, config, state=None, layer_number: int | None = None) -> Norm:
        """The model's norm (``--normalization``, ``--norm-epsilon``) over the hidden size: the layer
        spec's norm factory (``state`` and ``layer_number`` are not needed)."""
        return cls(config.hidden_size, config.normalization, config.norm_epsilon,
                   sequence_parallel=config.sequence_parallel, dtype=config.params_dtype,
                   zero_centered=config.apply_layernorm_1p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (self.weight + 1 if self.zero_centered else self.weight), self.bias
        mixed = x.dtype == torch.float32 and weight.dtype != torch.float32
        if mixed:  # --fp32-residual-connection: the fp32 stream normalised in fp32, returned in the weights' dtype
            weight, bias = weight.float(), None if bias is None else bias.float()
        if self.kind == "LayerNorm":
            out = F.layer_norm(x, (self.hidden_size,), weight, bias, self.eps)
        else:
            out = F.rms_norm(x, (self.hidden_size,), weight, self.eps)
        return out.to(self.weight.dtype) if mixed else out


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings (RoPE), in the "rotate half" layout: the head dim is split into two
# halves that rotate together, with frequencies base^(-2i/d); or, with --rotary-interleaved, adjacent
# channel pairs (the same tables, read one entry per pair).


def rotary_cos_sin(position_ids: torch.Tensor, dim: int, base: float = 10000.0, dtype=torch.float32, *,
                   inv_freq: torch.Tensor | None = None, mscale: float = 1.0):
    """cos and sin tables ``[s, b, 1, dim]`` for ``position_ids [b, s]`` (computed in fp32), from the
    frequencies ``base^(-2i/dim)`` or the given ``inv_freq [dim/2]``, times ``mscale`` (YaRN's)."""
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = position_ids.t().float().unsqueeze(-1) * inv_freq.to(position_ids.device)  # [s, b, dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)  # [s, b, 1, dim]
    if mscale == 1.0:
        return angles.cos().to(dtype), angles.sin().to(dtype)
    return (angles.cos() * mscale).to(dtype), (angles.sin() * mscale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [s, b, heads, dim]`` by the position angles (same shape tables, broadcast over heads)."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos + rotated * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``--rotary-interleaved``: rotate the adjacent pairs ``(x[2i], x[2i+1])`` of ``x [s, b, heads, dim]`` by
    angle ``i`` of the (rotate-half) tables ``[s, b, 1, dim]``, whose first half holds one angle per pair."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
