"""Small pieces shared by the transformer models: seeded init, normalisation, rotary embeddings.

Seeded init: every parameter's full ("master") weight is drawn from its own generator, seeded by
``(seed, global layer number, parameter name)``. Layer 0 is the embedding, layers 1..L are the
transformer layers, L + 1 the output layer. A model split over any tensor-parallel size or any
pipeline layer range therefore holds exactly the slices of the single-process weights.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor import normal_init, scaled_normal_init

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def param_seed(seed: int, layer_number: int, name: str) -> int:
    """A 63-bit seed derived from (seed, layer number, parameter name); stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}/{layer_number}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_init(seed: int, layer_number: int, name: str, std: float, num_layers: int | None = None):
    """``init_method`` for one parameter: N(0, std^2), or Megatron's scaled std / sqrt(2 L) when
    ``num_layers`` is given (the output projections of attention and MLP)."""
    gen = torch.Generator().manual_seed(param_seed(seed, layer_number, name))
    if num_layers is not None:
        return scaled_normal_init(std, num_layers, gen)
    return normal_init(std, gen)


def init_replicated(param: nn.Parameter, init_method) -> None:
    """Fill a replicated (not tensor-parallel) parameter from its full master weight."""
    master = torch.empty(param.shape, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        param.copy_(master)


class Norm(nn.Module):
    """LayerNorm (weight + bias) or RMSNorm (weight only) over the last dim.

    Replicated over tensor-parallel ranks. Under sequence parallelism each rank normalises only
    its sequence shard, so its weight gradient is partial: the parameters carry
    ``sequence_parallel = True`` and the training code sums their gradients over TP.
    """

    def __init__(self, hidden_size: int, kind: str = "LayerNorm", eps: float = 1e-5, *,
                 sequence_parallel: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        if kind not in NORMALIZATIONS:
            raise ValueError(f"--normalization {kind!r} is not one of {', '.join(NORMALIZATIONS)}")
        self.kind, self.eps, self.hidden_size = kind, eps, hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.weight.sequence_parallel = sequence_parallel
        if kind == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "LayerNorm":
            return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings (RoPE), in the "rotate half" layout: the head dim is split into two
# halves that rotate together, with frequencies base^(-2i/d).


def rotary_cos_sin(position_ids: torch.Tensor, dim: int, base: float = 10000.0, dtype=torch.float32):
    """cos and sin tables ``[s, b, 1, dim]`` for ``position_ids [b, s]`` (computed in fp32)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim))
    angles = position_ids.t().float().unsqueeze(-1) * inv_freq  # [s, b, dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)  # [s, b, 1, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [s, b, heads, dim]`` by the position angles (same shape tables, broadcast over heads)."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos + rotated * sin
