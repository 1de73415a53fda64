"""The MoE layer: router, token dispatcher, local experts and optional shared experts.

``MoELayer(config, state, layer_number)`` replaces the MLP of a transformer layer:
``forward(hidden [s, b, h]) -> [s, b, h]`` where ``s`` is this rank's sequence shard under sequence
parallelism. Expert parallelism (EP) is carved out of data parallelism: each EP rank holds
``num_experts / EP`` experts and receives the tokens routed to them from the other EP ranks (which
hold other data). Expert tensor parallelism uses the tensor-parallel group (or, with a folded expert
grid, its own ETP group of the re-cut stage: megatron_lite/parallel/expert_grid.py): with sequence
parallelism each rank routes its own sequence shard. Without it (inference at TP > 1: decoding feeds
whole sequences, one token at a time) every TP rank holds all tokens, and the layer cuts them into
one share per rank (padded to a multiple of TP), routes its share as under sequence parallelism, and
all-gathers the outputs (``TransformerConfig.moe_split_tokens_over_tp``, set by the inference
loader). Training at TP > 1 keeps Megatron's rule that MoE needs ``--sequence-parallel`` (the
router's and whole experts' gradients are summed over TP only under sequence parallelism).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..parallel import comm
from ..parallel.random import checkpoint
from ..parallel.recompute import recompute_modules
from ..precision.fp8_block import token_alignment
from .dispatcher import AllGatherDispatcher, AllToAllDispatcher
from .experts import GroupedExperts, SequentialExperts
from .router import TopKRouter
from .shared_experts import SharedExperts


def check_layer_config(config, state) -> None:
    """The combinations a layer cannot run (the config validation reports them earlier, with flags)."""
    if config.num_experts % state.ep_size:
        raise ConfigError(f"--num-experts {config.num_experts} must be divisible by "
                          f"--expert-model-parallel-size {state.ep_size}")
    etp = config.expert_tensor_parallel_size
    if state.folded and (etp or state.tp_size) != state.etp_size:
        raise ConfigError(f"--expert-tensor-parallel-size {etp} differs from the parallel state's expert grid "
                          f"(ETP {state.etp_size}); build the state with the same size")
    if not state.folded and etp not in (None, 1, state.tp_size):
        raise ConfigError(f"--expert-tensor-parallel-size {etp} must be 1 or --tensor-model-parallel-size "
                          f"{state.tp_size} unless the parallel state folds the experts (ParallelState(etp=...))")
    if config.moe_router_padding_for_fp8 and config.moe_token_dispatcher_type != "alltoall":
        raise ConfigError("--moe-router-padding-for-fp8 needs --moe-token-dispatcher-type alltoall")


def fp8_pad_multiple(config, layer_number: int) -> int | None:
    """With ``--moe-router-padding-for-fp8``, the multiple each expert's token count is padded to in an
    FP8 layer (:func:`~megatron_lite.precision.fp8_block.token_alignment` of the recipe); else None
    (a layer kept in bf16 by ``--first-last-layers-bf16`` is not padded)."""
    if not config.moe_router_padding_for_fp8 or not config.is_fp8_layer(layer_number):
        return None
    return token_alignment(config.fp8_recipe)


class MoELayer(nn.Module):
    compile_eagerly = True  # --torch-compile: a graph break (fusions/compile.py)

    def __init__(self, config, state, layer_number: int):
        super().__init__()
        check_layer_config(config, state)
        self.layer_number = layer_number
        self.router = TopKRouter(config, state, layer_number)
        experts = GroupedExperts if config.moe_grouped_gemm else SequentialExperts
        self.experts = experts(config, state, layer_number)
        if config.moe_token_dispatcher_type == "alltoall":
            self.token_dispatcher = AllToAllDispatcher(config, state, pad_multiple=fp8_pad_multiple(config, layer_number))
        else:
            self.token_dispatcher = AllGatherDispatcher(config, state)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExperts(config, state, layer_number)
        self.recompute_shared = "shared_experts" in recompute_modules(config)
        self.tracker = state.rng_tracker
        self.tp_group, self.tp_size = state.tp_group, comm.group_size(state.tp_group)
        self.split_tokens = self.tp_size > 1 and not config.sequence_parallel  # (moe_split_tokens_over_tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        s, b, h = hidden.shape
        out = self._routed_split(hidden) if self.split_tokens else self._routed(hidden)
        out = out.view(s, b, h).to(hidden.dtype)
        if self.shared_experts is not None and self.recompute_shared and torch.is_grad_enabled():
            out = out + checkpoint(self.shared_experts, hidden, tracker=self.tracker)  # --recompute-modules
        elif self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out

    def _routed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for ``hidden [s, b, h]``, as ``[s * b, h]``."""
        s, b, h = hidden.shape
        probs, routing_map = self.router(hidden)
        return self.token_dispatcher.run(hidden.reshape(s * b, h), probs, routing_map, self.experts)

    def _routed_split(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`_routed` of tokens every TP rank holds: each rank routes its share, outputs all-gathered."""
        s, b, h = hidden.shape
        tokens = hidden.reshape(s * b, 1, h)
        pad = -tokens.shape[0] % self.tp_size
        if pad:  # zero tokens, routed like any other and dropped below
            tokens = torch.cat([tokens, tokens.new_zeros(pad, 1, h)])
        mine = comm.scatter_to_sp(tokens, self.tp_group)
        out = comm.gather_from_sp(self._routed(mine), self.tp_group, tensor_parallel_output_grad=False)
        return out[: s * b]
