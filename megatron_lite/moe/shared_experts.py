"""Shared experts: a dense MLP every token goes through, added to the routed experts' output.

Its width is ``--moe-shared-expert-intermediate-size`` (the total of all shared experts). It is
replicated over expert-parallel ranks and tensor-parallel like the dense MLP (fc1 column-parallel,
fc2 row-parallel; under sequence parallelism fc1 all-gathers the sequence and fc2 reduce-scatters
it), with the dense MLP's activation, fused with fc1's bias under the same flags (``--bias-gelu-fusion``,
``--bias-swiglu-fusion``: :mod:`megatron_lite.fusions.activations`). With ``moe_shared_expert_gate``
its output is scaled per token by ``sigmoid(x . w_gate)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import MLPActivation, is_gated
from ..fusions.activations import bias_activation_impl
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear
from .experts import fused_activation_applies, gelu_approximation
from .router import init_replicated


class SharedExperts(nn.Module):
    def __init__(self, config, state, layer_number: int):
        super().__init__()
        ffn, h = config.moe_shared_expert_intermediate_size, config.hidden_size
        self.swiglu, self.gelu_approximate = config.swiglu, gelu_approximation(config)
        self.act, gated = MLPActivation(config, self.gelu_approximate), is_gated(config)
        sp, bias, dtype = bool(config.sequence_parallel), bool(config.add_bias_linear), config.params_dtype
        self.fused_activation = fused_activation_applies(config, self.act, bias)
        self.linear_fc1 = ColumnParallelLinear(
            h, 2 * ffn if gated else ffn, state.tp_group, bias=bias,
            init_method=config.init_method(layer_number, "mlp.shared_experts.linear_fc1.weight"),
            sequence_parallel=sp, stride=2 if gated else 1, dtype=dtype, skip_bias_add=self.fused_activation,
            gemm=config.make_gemm(layer_number, state.group("tp_cp")))
        self.linear_fc2 = RowParallelLinear(
            ffn, h, state.tp_group, bias=bias, input_is_parallel=True,
            init_method=config.init_method(layer_number, "mlp.shared_experts.linear_fc2.weight", scaled=True),
            sequence_parallel=sp, dtype=dtype, gemm=config.make_gemm(layer_number, state.group("tp_cp")))
        self.gate_weight = None
        if getattr(config, "moe_shared_expert_gate", False):
            self.gate_weight = nn.Parameter(torch.empty(1, h, dtype=dtype))
            init_replicated(self.gate_weight, config.init_method(layer_number, "mlp.shared_experts.gate_weight"))
            self.gate_weight.sequence_parallel = sp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused_activation:
            x, bias = self.linear_fc1(hidden)
            x = bias_activation_impl(x, bias, self.swiglu)
        else:
            x = self.act(self.linear_fc1(hidden))
        out = self.linear_fc2(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(hidden, self.gate_weight))
        return out
