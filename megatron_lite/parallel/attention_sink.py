"""Attention sinks (``--softmax-type``, Megatron-LM's flag and values): one more logit per head that
joins every row's softmax denominator and is read by no value.

* ``vanilla`` (default): ``p_j = exp(s_j) / sum_k exp(s_k)``.
* ``off-by-one``: the extra logit is 0, ``p_j = exp(s_j) / (1 + sum_k exp(s_k))``.
* ``learnable``: head ``h``'s logit is a trained parameter, ``core_attention.softmax_offset[h]``
  (gpt-oss's "sinks"): shape ``[heads]``, split by heads under tensor parallelism like the query
  heads (``partition_dim`` 0), initialised to 0, without weight decay (1-D), saved in checkpoints.

A row may now give its attention to nothing: its probabilities sum to ``1 - exp(sink - L)``. Every
attention path computes the sink from a row's log-sum-exp ``lse`` of the real scores: with
``L = logaddexp(lse, sink)`` the output is ``out * exp(lse - L)`` (:func:`merge_sink`). Backward needs
nothing new for q, k and v: the standard attention backward given the final output and ``L`` is
exact (the sink's value is zero, so ``D = rowsum(dO * O)`` is unchanged), and the sink's gradient is
``-sum over rows of exp(sink - L) * D`` (:func:`sink_grad`). Ring attention merges the sink once per
row, after its blocks. The explicit (``--no-masked-softmax-fusion``) and CPU-dropout paths add the
sink to their own softmax. A row whose every key is masked out gives zeros (all mass on the sink).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_softmax_type(config) -> None:
    """Validate ``--softmax-type`` of a TransformerConfig (one line naming the flag)."""
    kind = getattr(config, "softmax_type", "vanilla")
    if kind not in SOFTMAX_TYPES:
        raise ConfigError(f"--softmax-type {kind!r} is not one of {', '.join(SOFTMAX_TYPES)}")


def softmax_offset(config, state) -> nn.Parameter | None:
    """The learnable sink logits of this rank's query heads (``--softmax-type learnable``), else None."""
    if getattr(config, "softmax_type", "vanilla") != "learnable":
        return None
    heads, tp = config.num_attention_heads, state.tp_size
    param = nn.Parameter(torch.zeros(heads // tp, dtype=getattr(config, "params_dtype", torch.float32)))
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
    return param


def sink_logits(softmax_type: str, offset, heads: int, device) -> torch.Tensor | None:
    """The fp32 sink logit of each of ``heads`` local query heads: None (vanilla), zeros (off-by-one)
    or the learnable ``offset`` (autograd reaches it)."""
    if softmax_type == "vanilla":
        return None
    if offset is None:
        return torch.zeros(heads, device=device)
    return offset.float()


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Fold the sink into a finished row: ``out [b, nq, s, dv]`` rescaled in place, the new lse returned.

    ``lse [b, nq, s]`` (fp32/fp64; -inf for a row that saw no key) -> ``logaddexp(lse, sink)``."""
    new = torch.logaddexp(lse, sink.to(lse.dtype).view(1, -1, 1))
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    return new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``d loss / d sink [nq]`` from the final ``out``, its upstream gradient ``dout [b, nq, s, dv]`` and
    the final (sink included) ``lse [b, nq, s]``."""
    row_dot = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(torch.exp(sink.to(lse.dtype).view(1, -1, 1) - lse) * row_dot).sum((0, 2))
