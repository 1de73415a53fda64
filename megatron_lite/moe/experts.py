"""The local experts of an MoE layer: a sequential loop or one grouped GEMM over all of them.

Both take the tokens this rank computes, already grouped by local expert:
``forward(x [N, h], probs [N], tokens_per_expert: list[int]) -> [N, h]`` where expert j owns rows
``[sum(tokens_per_expert[:j]), sum(tokens_per_expert[:j+1]))``. Each expert is an MLP
``fc2(act(fc1(x)) * p)``: the routing weight multiplies the activation (before fc2), and fc2's bias
is weighted by ``p`` too, so a token's output is exactly ``p * expert(x)``. ``act`` is the dense
MLP's (:mod:`megatron_lite.activations`; GeLU in the same form: :func:`gelu_approximation`).
Under the dense MLP's flags (``--bias-gelu-fusion``, ``--bias-swiglu-fusion``: a plain GeLU or SwiGLU)
fc1 leaves its bias out and the dense MLP's fused functions (:mod:`megatron_lite.fusions.activations`)
add it and apply the activation, with their hand-written backward; the grouped experts hand them one
bias row per token (its expert's). With ``--squared-relu`` the weighted activation is ``relu(h)^2 * p`` in one function, which is what
Megatron's ``--use-fused-weighted-squared-relu`` fuses.

Weights: expert ``e`` (global index) draws its full fc1 ``[ffn (x2 for SwiGLU), h]`` and fc2
``[h, ffn]`` master weights from generators seeded by its own name, and this rank keeps the
expert-tensor-parallel slice (fc1 by rows with stride 2 for a gated unit's gate/linear halves, fc2 by
columns). Any expert-parallel or expert-tensor-parallel layout therefore holds exactly the
single-process weights. With expert tensor parallelism the output is this rank's partial sum;
the dispatcher reduces it (fc2's bias is added on expert-tensor rank 0 only).

FP8 (and any other GEMM recipe): every expert's fc1 and fc2 get their own gemm from
``config.make_gemm(layer_number, state.group("expert_amax"), expert=True)`` (None: plain ``F.linear``), so
each expert's weight, input and gradient has its own scale. The grouped experts then run one GEMM per
expert (``torch._scaled_grouped_mm`` has no CPU kernel), on views of the stacked weights. The
amaxes are reduced over ``expert_amax``: the copies of the same experts whose tokens together are
those of the same micro-batches (unfolded: tensor x context parallelism, the experts sharded over TP
or replicated with each rank feeding its own tokens, each CP rank its own sequence chunks; folded:
the ETP shards and the replicas fed other chunks of the same micro-batches) and, once per step,
over the expert-data-parallel group; never over expert parallelism, which holds different experts. An expert that gets no token still
runs its (empty) GEMM, so collective calls match across ranks; its amax of 0 keeps the old scale.

Expert parameters carry ``is_expert = True`` and ``allreduce = False`` when expert parallelism is
on (EP > 1) or the expert grid is folded: their gradients are then reduced over the
expert-data-parallel group only. With a folded grid (megatron_lite/parallel/expert_grid.py) the
expert-tensor group is the grid's ETP group, whole experts (ETP 1) are not replicated over TP, and
fc2's bias is summed over the ETP group (``sum_over_etp``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import MLPActivation, is_gated
from ..fusions.activations import bias_activation_impl
from ..parallel import comm
from ..parallel.recompute import recompute_modules, run_discarding
from ..parallel.tensor import shard


def gelu_approximation(config) -> str:
    """The GeLU of the model's dense MLP (models/mlp.py), which experts use too, as Megatron's expert
    MLPs do: the tanh form with ``--openai-gelu`` or with bias + GeLU fusion (its kernel is the tanh
    form), else the exact erf form."""
    tanh = getattr(config, "openai_gelu", False) or getattr(config, "bias_activation_fusion", False)
    return "tanh" if tanh else "none"


def fused_activation_applies(config, act: MLPActivation, bias: bool) -> bool:
    """Whether experts (routed or shared) take their fc1 bias + activation through the fused functions:
    the dense MLP's rule (models/mlp.py), a plain GeLU or SwiGLU under the fusion flag; the fused GeLU
    needs its bias (TransformerConfig refuses the dense GeLU fusion without one)."""
    return bool(getattr(config, "bias_activation_fusion", False)) and act.plain and (config.swiglu or bias)


def grouped_mm_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` serves these operands: present in this torch, on CPU (any float
    dtype) or CUDA (bf16), with rows a multiple of 16 bytes (its alignment rule)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.device.type == "cuda":
        ok_device = x.dtype == torch.bfloat16
    else:
        ok_device = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
    align = 16 // x.element_size()
    return ok_device and x.shape[-1] % align == 0 and weight.shape[-1] % align == 0


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` with its backward as two more grouped GEMMs on views (no copies):
    ``dx = dy @ w^T`` per group and ``dw_j = x_j^T @ dy_j`` (the 2-D x 2-D form, groups along rows).
    The incoming gradient is made contiguous first (a broadcast gradient has zero strides, which
    the kernel rejects)."""

    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(x, weight, offsets)
        return torch._grouped_mm(x, weight, offs=offsets)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, weight.transpose(1, 2), offs=offsets) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(x.t(), dy, offs=offsets) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
    """``x [N, K]`` grouped by expert times ``weight [E, K, M]``: rows of expert j use ``weight[j]``.

    ``torch._grouped_mm`` where it serves the operands, else one padded batched matmul: the rows
    are scattered into ``[E, max_rows, K]`` (zero padding), multiplied by ``torch.bmm`` and gathered
    back. Both are one kernel for all experts and exact under autograd.
    """
    if grouped_mm_available(x, weight) and x.shape[0] > 0:  # (the kernel rejects an empty gradient)
        offsets = torch.tensor(tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
        return _GroupedMM.apply(x.contiguous(), weight.contiguous(), offsets)
    return padded_batched_matmul(x, weight, tokens_per_expert)


def padded_batched_matmul(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
    """The fallback of :func:`grouped_matmul`: rows scattered into ``[E, max_rows, K]``, one ``bmm``."""
    experts, max_rows = weight.shape[0], max(tokens_per_expert, default=0)
    rows = _padded_rows(tokens_per_expert, max_rows, x.device)
    padded = x.new_zeros(experts * max_rows, x.shape[1]).index_copy(0, rows, x)
    out = torch.bmm(padded.view(experts, max_rows, x.shape[1]), weight)
    return out.view(experts * max_rows, weight.shape[-1]).index_select(0, rows)


def _padded_rows(tokens_per_expert: list[int], max_rows: int, device) -> torch.Tensor:
    """Row of each token in the padded ``[E * max_rows]`` layout."""
    counts = torch.tensor(tokens_per_expert, dtype=torch.long)
    starts = torch.arange(len(tokens_per_expert), dtype=torch.long) * max_rows
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]])
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(offsets, counts)
    return (torch.repeat_interleave(starts, counts) + within).to(device)


def expert_tp_group(config, state):
    """The group the experts are split over: the tensor-parallel group, or none (whole experts on
    every TP rank) with ``--expert-tensor-parallel-size 1``; with a folded expert grid, its ETP group."""
    if getattr(state, "folded", False):
        return state.etp_group
    return None if config.expert_tensor_parallel_size == 1 else state.tp_group


def _mark(param: nn.Parameter, own_dp_group: bool, partition_dim: int | None, replicated_over_tp: bool) -> None:
    param.is_expert = True
    param.allreduce = not own_dp_group
    if partition_dim is not None:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, partition_dim, 1
    # whole experts on every TP rank, each fed its own sequence shard's tokens: sum the grads over TP
    param.sequence_parallel = replicated_over_tp


class _ExpertWeights:
    """Master weights of one expert, sliced for this expert-tensor-parallel rank."""

    def __init__(self, config, layer_number: int, expert: int, etp_rank: int, etp_size: int):
        ffn, h = config.moe_ffn_hidden_size, config.hidden_size
        fc1_rows = 2 * ffn if is_gated(config) else ffn
        fc1 = torch.empty(fc1_rows, h)
        config.init_method(layer_number, f"mlp.experts.{expert}.linear_fc1.weight")(fc1)
        fc2 = torch.empty(h, ffn)
        config.init_method(layer_number, f"mlp.experts.{expert}.linear_fc2.weight", scaled=True)(fc2)
        self.stride = 2 if is_gated(config) else 1
        self.fc1 = shard(fc1, 0, etp_rank, etp_size, self.stride)
        self.fc2 = shard(fc2, 1, etp_rank, etp_size)


class _ExpertsBase(nn.Module):
    def __init__(self, config, state):
        super().__init__()
        self.swiglu, self.dtype = config.swiglu, config.params_dtype
        self.gelu_approximate = gelu_approximation(config)
        self.act = MLPActivation(config, self.gelu_approximate)
        self.bias = bool(config.add_bias_linear)
        self.fused_activation = fused_activation_applies(config, self.act, self.bias)
        self.num_local_experts = config.num_experts // state.ep_size
        self.first_expert = state.ep_rank * self.num_local_experts
        self.etp_group = expert_tp_group(config, state)
        self.etp_rank, self.etp_size = comm.group_rank(self.etp_group), comm.group_size(self.etp_group)
        self.folded = getattr(state, "folded", False)
        self.replicated_over_tp = self.etp_group is None and state.tp_size > 1 and not self.folded
        self.ep_size = state.ep_size
        self.own_dp_group = self.ep_size > 1 or self.folded  # reduced over the expert-DP group
        # split like the dense layers (over the TP group) unless --expert-tensor-parallel-size 1; marked
        # as such even at TP 1, so a checkpoint records how to reshard the experts to another TP size.
        # A folded grid always marks them (split over its ETP group, even of one rank): its torch_dist
        # boxes then reshard across every folded ETP size
        self.expert_tp = config.expert_tensor_parallel_size != 1 or self.folded
        self.ffn_local = config.moe_ffn_hidden_size // self.etp_size
        self.fc1_local = 2 * self.ffn_local if is_gated(config) else self.ffn_local
        self.recompute_act = "moe_act" in recompute_modules(config)

    def _param(self, data: torch.Tensor, partition_dim: int | None) -> nn.Parameter:
        param = nn.Parameter(data.to(self.dtype).contiguous())
        _mark(param, self.own_dp_group, partition_dim if self.expert_tp else None, self.replicated_over_tp)
        return param

    def _bias2(self, shape) -> nn.Parameter:
        """fc2's bias is whole on every expert-tensor rank; only rank 0 adds it, and the gradient is
        summed over the group like a sequence-parallel weight's."""
        param = self._param(torch.zeros(shape), None)
        if self.folded:  # summed over the folded ETP group (finalize_model_grads), not over TP
            param.sum_over_etp = self.etp_size > 1
        else:
            param.sequence_parallel = self.etp_size > 1 or self.replicated_over_tp
        return param

    def _weighted(self, h: torch.Tensor, probs: torch.Tensor, *bias: torch.Tensor) -> torch.Tensor:
        """``act(h + bias) * p``. ``bias``, given only with the fused activation (which adds it): fc1's
        bias, or the grouped experts' stacked biases ``[E_l, fc1]`` and each row's local expert."""
        if not self.fused_activation:
            act = self.act(h)
        else:
            row_bias = bias[0][bias[1]] if len(bias) == 2 else (bias[0] if bias else None)
            act = bias_activation_impl(h, row_bias, self.swiglu)
        return (act * probs.unsqueeze(-1)).to(h.dtype)

    def _fc2_of_weighted(self, h: torch.Tensor, probs: torch.Tensor, fc2, *bias: torch.Tensor) -> torch.Tensor:
        """``fc2(_weighted(h, probs, *bias))``; under ``--recompute-modules moe_act`` the weighted activation
        (fc2's input) is freed after fc2's forward and computed again before its backward (from its inputs:
        the grouped experts pass their stacked biases and row indices, not the gathered ``[N, fc1]`` rows)."""
        args = (h, probs, *bias)
        if not self.recompute_act:
            return fc2(self._weighted(*args))
        x, holder = run_discarding(self._weighted, *args)
        y = fc2(x)
        if holder is not None:
            holder.discard(y)
        return y

    @staticmethod
    def _linear_pair(config, state, layer_number: int) -> nn.Module:
        """``linear_fc1`` and ``linear_fc2`` of one expert, each holding its gemm (None: F.linear)."""
        expert = nn.Module()
        expert.linear_fc1, expert.linear_fc2 = nn.Module(), nn.Module()
        for fc in (expert.linear_fc1, expert.linear_fc2):  # amaxes over the copies fed the same micro-batches
            fc.gemm = config.make_gemm(layer_number, state.group("expert_amax"), expert=True)
        return expert


def _linear(fc: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``x @ weight.T + bias`` through ``fc``'s gemm (an FP8 gemm) or F.linear, plus ``fc``'s LoRA
    adapter when it has one (megatron_lite/lora/experts.py)."""
    out = F.linear(x, weight, bias) if fc.gemm is None else fc.gemm(x, weight, bias)
    adapter = getattr(fc, "adapter", None)
    return out if adapter is None else out + adapter(x)


class SequentialExperts(_ExpertsBase):
    """One MLP per local expert, run one after another (``local_experts.{j}.linear_fc{1,2}``)."""

    def __init__(self, config, state, layer_number: int):
        super().__init__(config, state)
        self.local_experts = nn.ModuleList()
        for j in range(self.num_local_experts):
            w = _ExpertWeights(config, layer_number, self.first_expert + j, self.etp_rank, self.etp_size)
            expert = self._linear_pair(config, state, layer_number)
            expert.linear_fc1.weight = self._param(w.fc1, 0)
            expert.linear_fc1.weight.partition_stride = w.stride
            expert.linear_fc2.weight = self._param(w.fc2, 1)
            if self.bias:
                expert.linear_fc1.bias = self._param(torch.zeros(self.fc1_local), 0)
                expert.linear_fc1.bias.partition_stride = w.stride
                expert.linear_fc2.bias = self._bias2(config.hidden_size)
            self.local_experts.append(expert)

    def forward(self, x: torch.Tensor, probs: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        outputs = []
        for expert, rows, p in zip(self.local_experts, x.split(tokens_per_expert), probs.split(tokens_per_expert)):
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            bias1 = getattr(fc1, "bias", None)
            fused_bias = (bias1,) if self.fused_activation and bias1 is not None else ()  # the fused activation adds it
            h = _linear(fc1, rows, fc1.weight, None if self.fused_activation else bias1)
            y = self._fc2_of_weighted(h, p, lambda x, fc2=fc2: _linear(fc2, x, fc2.weight), *fused_bias)
            if self.bias and self.etp_rank == 0:
                y = y + fc2.bias * p.unsqueeze(-1).to(y.dtype)
            outputs.append(y)
        if not outputs:
            return x.new_zeros(0, x.shape[-1])
        return torch.cat(outputs)


class GroupedExperts(_ExpertsBase):
    """All local experts in two stacked weights ``weight1 [E_l, h, fc1]`` and ``weight2 [E_l, ffn, h]``
    (fc1/fc2 transposed), computed with one grouped GEMM each. With a GEMM recipe (FP8) the
    per-expert gemms live in ``local_experts.{j}.linear_fc{1,2}.gemm`` (the sequential experts'
    names, so checkpoints merge the same way) and each expert runs its own GEMM."""

    def __init__(self, config, state, layer_number: int):
        super().__init__(config, state)
        pairs = [self._linear_pair(config, state, layer_number) for _ in range(self.num_local_experts)]
        self.local_experts = nn.ModuleList(pairs) if pairs and pairs[0].linear_fc1.gemm is not None else None
        ws = [_ExpertWeights(config, layer_number, self.first_expert + j, self.etp_rank, self.etp_size)
              for j in range(self.num_local_experts)]
        self.weight1 = self._param(torch.stack([w.fc1.t() for w in ws]), 2)
        self.weight2 = self._param(torch.stack([w.fc2.t() for w in ws]), 1)
        self.weight1.partition_stride = ws[0].stride if ws else 1
        if self.bias:
            self.bias1 = self._param(torch.zeros(self.num_local_experts, self.fc1_local), 1)
            self.bias1.partition_stride = self.weight1.partition_stride
            self.bias2 = self._bias2((self.num_local_experts, config.hidden_size))
            for bias in (self.bias1, self.bias2):  # stacked [E, n]: no weight decay, like a 1-D bias
                bias.no_weight_decay = True

    def forward(self, x: torch.Tensor, probs: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        h, fused_bias = self._matmul(x, self.weight1, "linear_fc1", tokens_per_expert), ()
        if self.bias:
            expert_of_row = torch.repeat_interleave(
                torch.arange(self.num_local_experts, device=x.device),
                torch.tensor(tokens_per_expert, device=x.device))
            if self.fused_activation:  # the fused activation adds each row's expert's bias
                fused_bias = (self.bias1, expert_of_row)
            else:
                h = h + self.bias1[expert_of_row]
        y = self._fc2_of_weighted(h, probs, lambda x: self._matmul(x, self.weight2, "linear_fc2", tokens_per_expert),
                                  *fused_bias)
        if self.bias and self.etp_rank == 0:
            y = y + self.bias2[expert_of_row] * probs.unsqueeze(-1).to(y.dtype)
        return y

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor, fc: str, tokens_per_expert: list[int]) -> torch.Tensor:
        """Rows of expert j times ``weight[j]``: one grouped GEMM, or each expert's own gemm; plus the
        stacked LoRA adapters of ``fc`` when there are (megatron_lite/lora/experts.py)."""
        if self.local_experts is None:
            out = grouped_matmul(x, weight, tokens_per_expert)
        else:
            parts = [_linear(getattr(expert, fc), rows, w.t())
                     for expert, rows, w in zip(self.local_experts, x.split(tokens_per_expert), weight.unbind(0))]
            out = torch.cat(parts) if parts else x.new_zeros(0, weight.shape[-1])
        adapter = getattr(self, f"{fc}_adapter", None)
        return out if adapter is None else out + adapter(x, tokens_per_expert)
