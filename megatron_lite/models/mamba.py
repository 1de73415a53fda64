"""The Mamba-2 mixer of hybrid models, in plain PyTorch: in_proj -> causal depthwise conv1d + SiLU over
(x, B, C) -> the SSD state-space scan -> gated RMSNorm -> out_proj.

Per head ``h`` (``P`` channels) the state ``S [P, N]`` follows
``S_t = exp(dt_t A_h) S_(t-1) + dt_t x_t B_t^T`` and the output is ``y_t = S_t C_t + D_h x_t``, with
``A_h = -exp(A_log_h)`` a scalar per head, ``dt_t = softplus(dt_raw_t + dt_bias_h)``, and ``B``, ``C``
(``N`` wide) shared by the heads of a group. :func:`ssd_scan` computes it chunk by chunk (the SSD
form: a masked decay matrix inside each chunk, one state carried between chunks);
:func:`sequential_scan` is the step-by-step recurrence it is tested against. The gated norm is
``rmsnorm(y * silu(z))`` normalised over each group's channels.

Tensor parallelism splits the groups (with their heads) over TP: ``in_proj`` is column-parallel,
``out_proj`` row-parallel, the conv1d channels, ``A_log``, ``D``, ``dt_bias`` and the norm weight are
split with them, so a rank's mixer needs no communication of its own (sequence parallelism: in_proj
all-gathers the sequence, out_proj reduce-scatters it). To keep every TP size slicing the same master
weights, ``in_proj``'s rows are group-major: for each group ``[z; x; B; C; dt]`` of that group's heads
(``conv1d``'s channels likewise ``[x; B; C]`` per group), not Megatron-LM's ``[z; x; B; C; dt]`` over
all heads.

The mixer sits in the layer's ``self_attention`` slot (parameters
``decoder.layers.N.self_attention.in_proj.weight`` ...), so the layer's norm, residual, dropout and
recomputation are the transformer layer's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..parallel import comm
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear, shard
from .common import param_generator
from .mamba_config import MAMBA_CHUNK_SIZE, MAMBA_CONV_KERNEL, mamba_sizes

DT_MIN, DT_MAX, DT_FLOOR, A_RANGE = 0.001, 0.1, 1e-4, (1.0, 16.0)  # Megatron-LM's MambaMixer init


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, l, g, n]`` -> ``[b, l, heads, n]``: each group's B or C repeated for its heads."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def sequential_scan(x, dt, A, B, C):
    """The recurrence one step at a time (the reference): ``x [b, l, h, p]``, ``dt [b, l, h]`` (after
    softplus), ``A [h]`` (negative), ``B``, ``C [b, l, g, n]``; returns ``y [b, l, h, p]`` without ``D x``."""
    b, l, h, p = x.shape
    B, C = _heads(B, h), _heads(C, h)
    state = x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = state * decay + torch.einsum("bhp,bhn->bhpn", x[:, t] * dt[:, t, :, None], B[:, t])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(ys, dim=1)


def ssd_scan(x, dt, A, B, C, chunk_size: int = MAMBA_CHUNK_SIZE):
    """:func:`sequential_scan` in chunks of ``chunk_size`` (the sequence is zero-padded to a multiple:
    ``dt = 0`` steps change nothing, and later steps never reach earlier outputs)."""
    b, l, h, p = x.shape
    B, C = _heads(B, h), _heads(C, h)
    chunk_size = min(chunk_size, l)  # a short sequence is one chunk (no padding)
    pad = (-l) % chunk_size
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    T = chunk_size
    c = x.shape[1] // T
    x, dt = x.reshape(b, c, T, h, p), dt.reshape(b, c, T, h)
    B, C = B.reshape(b, c, T, h, -1), C.reshape(b, c, T, h, -1)
    logd = torch.cumsum((dt * A).permute(0, 3, 1, 2), dim=-1)  # [b, h, c, T]: log decay from the chunk start
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    seg = (logd[..., :, None] - logd[..., None, :]).masked_fill(~causal, float("-inf"))  # [b, h, c, i, j]
    xdt = x * dt[..., None]
    scores = torch.einsum("bcihn,bcjhn->bhcij", C, B) * torch.exp(seg)
    y = torch.einsum("bhcij,bcjhp->bcihp", scores, xdt)  # inside each chunk
    to_end = torch.exp(logd[..., -1:] - logd)  # [b, h, c, T]
    states = torch.einsum("bhcj,bcjhn,bcjhp->bchpn", to_end, B, xdt)  # each chunk's own contribution
    chunk_decay = torch.exp(logd[..., -1])  # [b, h, c]
    carried, prev = [], x.new_zeros(b, h, p, B.shape[-1])
    for k in range(c):
        carried.append(prev)
        prev = prev * chunk_decay[:, :, k, None, None] + states[:, k]
    carried = torch.stack(carried, dim=1)  # [b, c, h, p, n]: the state entering each chunk
    y = y + torch.einsum("bcihn,bchpn,bhci->bcihp", C, carried, torch.exp(logd))
    return y.reshape(b, c * T, h, p)[:, :l]


def _up(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 when it is 16-bit, else itself."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _sharded(master: torch.Tensor, state) -> nn.Parameter:
    """A parameter holding this TP rank's dim-0 slice of ``master``."""
    tp = state.tp_group
    param = nn.Parameter(shard(master, 0, comm.group_rank(tp), comm.group_size(tp)).clone())
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
    return param


class MambaMixer(nn.Module):
    """``forward(hidden [s(/tp), b, h], ...) -> [s(/tp), b, h]`` (the layer spec's ``self_attention`` contract)."""

    def __init__(self, config, state, layer_number: int, core_attention=None):
        super().__init__()
        d_inner, heads, head_dim, groups, n = mamba_sizes(config)
        tp = comm.group_size(state.tp_group)
        self.tp = tp
        self.groups, self.heads = groups // tp, heads // tp  # this rank's
        self.head_dim, self.state_dim, self.per_group = head_dim, n, heads // groups
        self.eps = config.norm_epsilon
        width = self.per_group * head_dim
        self.block = 2 * width + 2 * n + self.per_group  # one group's in_proj rows: z, x, B, C, dt
        dtype, seed = config.params_dtype, config.seed
        name = "self_attention"
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, groups * self.block, state.tp_group, bias=False,
            init_method=config.init_method(layer_number, f"{name}.in_proj.weight"),
            sequence_parallel=config.sequence_parallel, gemm=config.make_gemm(layer_number, state.group("tp_cp")),
            dtype=dtype, gradient_accumulation_fusion=config.gradient_accumulation_fusion)
        self.out_proj = RowParallelLinear(
            d_inner, config.hidden_size, state.tp_group, bias=False, input_is_parallel=True,
            init_method=config.init_method(layer_number, f"{name}.out_proj.weight", scaled=True),
            sequence_parallel=config.sequence_parallel, gemm=config.make_gemm(layer_number, state.group("tp_cp")),
            dtype=dtype, gradient_accumulation_fusion=config.gradient_accumulation_fusion)
        conv_dim, k = groups * (width + 2 * n), MAMBA_CONV_KERNEL
        bound = 1 / math.sqrt(k)  # PyTorch's Conv1d default (fan-in = kernel width for a depthwise conv)

        def draw(what, shape, low, high):
            gen = param_generator(seed, layer_number, f"{name}.{what}")
            return torch.rand(shape, generator=gen, dtype=torch.float32) * (high - low) + low

        self.conv1d_weight = _sharded(draw("conv1d.weight", (conv_dim, k), -bound, bound).to(dtype), state)
        self.conv1d_bias = _sharded(draw("conv1d.bias", (conv_dim,), -bound, bound).to(dtype), state)
        dt = torch.exp(draw("dt_bias", (heads,), math.log(DT_MIN), math.log(DT_MAX))).clamp(min=DT_FLOOR)
        self.dt_bias = _sharded((dt + torch.log(-torch.expm1(-dt))).to(dtype), state)  # softplus^-1(dt)
        self.A_log = _sharded(torch.log(draw("A_log", (heads,), *A_RANGE)).to(dtype), state)
        self.D = _sharded(torch.ones(heads, dtype=dtype), state)
        self.norm_weight = _sharded(torch.ones(d_inner, dtype=dtype), state)

    def forward(self, hidden, attention_mask=None, rotary=None, causal: bool = True, inference_context=None):
        if inference_context is not None:
            raise ConfigError("generation with a hybrid Mamba model is not built (no Mamba state cache); "
                              "evaluate it with pretrain_gpt.py instead")
        proj = self.in_proj(hidden)  # [s, b, groups * block] (the whole sequence under SP)
        s, b = proj.shape[:2]
        width, n = self.per_group * self.head_dim, self.state_dim
        proj = proj.transpose(0, 1).reshape(b, s, self.groups, self.block)
        z, xbc, dt = torch.split(proj, [width, width + 2 * n, self.per_group], dim=-1)
        xbc = self._conv(xbc.reshape(b, s, -1)).reshape(b, s, self.groups, -1)
        x, B, C = torch.split(xbc, [width, n, n], dim=-1)
        up = _up  # the scan and the norm in fp32 (float64 stays float64)
        x = up(x.reshape(b, s, self.heads, self.head_dim))
        dt = F.softplus(up(dt.reshape(b, s, self.heads)) + up(self.dt_bias))
        A = -torch.exp(up(self.A_log))
        y = ssd_scan(x, dt, A, up(B), up(C)) + x * up(self.D)[:, None]
        gated = y.reshape(b, s, self.groups, width) * F.silu(up(z))
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        out = normed.reshape(b, s, -1) * up(self.norm_weight)
        return self.out_proj(out.to(self.D.dtype).transpose(0, 1))

    def _conv(self, xbc):
        """Causal depthwise conv1d (kernel 4) + SiLU over ``[b, s, channels]``."""
        k = self.conv1d_weight.shape[-1]
        t = F.pad(xbc.transpose(1, 2), (k - 1, 0))
        out = F.conv1d(t, self.conv1d_weight.unsqueeze(1), self.conv1d_bias, groups=t.shape[1])
        return F.silu(out).transpose(1, 2)
