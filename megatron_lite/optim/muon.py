"""Muon: momentum whose update is orthogonalised by a Newton-Schulz iteration, for the linear layers'
matrices; AdamW for the rest (``--optimizer muon``, Megatron-LM's flags in ``muon_config.py``).

One step of a Muon matrix ``W`` with gradient ``G`` (fp32, after clipping), learning rate ``lr`` and
weight decay ``wd`` (the schedule's):

* ``W <- W (1 - lr wd)`` (decoupled weight decay, as AdamW);
* ``M <- m M + (1 - m) G`` (``--muon-momentum`` m; an average, not SGD's sum);
* ``U = M``, or with ``--muon-use-nesterov`` ``U = G + m (M - G)``;
* ``W <- W - lr s e NS(U)``: ``NS`` the Newton-Schulz approximation of the nearest semi-orthogonal
  matrix (``U`` scaled to unit Frobenius norm, then ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, over
  the shorter side, with the five quintic (a, b, c) of :data:`COEFFICIENTS` repeated), ``s`` the
  ``--muon-scale-mode`` factor of the out x in matrix and ``e`` ``--muon-extra-scale-factor``.

Which tensors: 2-D weights of linear layers (attention, MLP, experts, router, LoRA adapters) and
each expert's matrix of the grouped experts' stacked ``[E, in, out]`` weights; not the embeddings,
the output layer, norms and biases. The fused query/key/value weight is cut per query group into its
Q, K and V rows, and all groups' Q (K, V) rows are orthogonalised as one matrix
(``--muon-no-split-qkv``: the whole weight). A tensor-parallel matrix (``--muon-tp-mode``): each rank's
block alone (blockwise, Megatron's default: the update depends on the TP size), the whole matrix after
an all-gather (duplicated), or the whole matrix with its Gram matrix all-reduced (distributed); the
last two equal one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import cycle, islice

import torch
import torch.distributed as dist

from ..parallel import comm

# Newton-Schulz coefficients (a, b, c) per step, the "quintic" set, cycled past the fifth step.
COEFFICIENTS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))


def newton_schulz(x: torch.Tensor, steps: int, *, group=None, transpose: bool | None = None,
                  bf16: bool = False, eps: float = 1e-7) -> torch.Tensor:
    """The approximate orthogonal polar factor of ``x`` (``[..., r, c]``, fp32; batched over leading
    dims). ``group``: ``x`` is this rank's columns of a matrix split over ``group`` (after the optional
    transpose): the norm and ``X X^T`` are summed over it. ``bf16``: iterate in bf16."""
    if transpose is None:
        transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.mT
    square = (x * x).sum(dim=(-2, -1), keepdim=True)
    if group is not None:
        dist.all_reduce(square, group=group)
    X = x / square.sqrt().clamp_min(eps)
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in islice(cycle(COEFFICIENTS), steps):
        A = X @ X.mT
        if group is not None:
            A = A.float()
            dist.all_reduce(A, group=group)
            A = A.to(X.dtype)
        X = a * X + (b * A + c * (A @ A)) @ X
    X = X.float()
    return X.mT if transpose else X


def scale_factor(out: int, inp: int, mode: str) -> float:
    """``--muon-scale-mode``'s factor for an ``out x inp`` matrix."""
    if mode == "spectral":
        return max(out, inp) ** 0.5
    if mode == "unit_rms_norm":
        return (out / inp) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, out / inp) ** 0.5
    raise ValueError(f"--muon-scale-mode {mode!r}")


@dataclass
class MuonMatrix:
    """How to orthogonalise one stepped tensor: its tensor-parallel split (``dim`` of the tensor, or
    None) over ``group``; ``transposed``: stored ``[..., in, out]`` (the grouped experts); ``qkv``:
    the Q, K, V rows per query group of a fused QKV weight, or None."""

    dim: int | None = None
    group: object = None
    transposed: bool = False
    qkv: tuple[int, int, int] | None = None


class Orthogonalizer:
    """``NS(U)`` times the scale factors, for the flags of one run."""

    def __init__(self, optim_config):
        o = optim_config
        self.steps, self.mode, self.tp_mode = o.muon_num_ns_steps, o.muon_scale_mode, o.muon_tp_mode
        self.extra, self.bf16 = o.muon_extra_scale_factor, o.muon_fp32_matmul_prec in ("low", "medium")
        self.precision = "high"

    def __call__(self, u: torch.Tensor, info: MuonMatrix) -> torch.Tensor:
        if info.qkv is None:
            return self._scaled(u, info)
        rows = sum(info.qkv)
        groups = u.shape[0] // rows
        parts = u.view(groups, rows, -1).split(list(info.qkv), dim=1)
        done = [self._scaled(p.reshape(-1, u.shape[-1]), info).view(groups, -1, u.shape[-1]) for p in parts]
        return torch.cat(done, dim=1).view(u.shape)

    def _scaled(self, u: torch.Tensor, info: MuonMatrix) -> torch.Tensor:
        split = info.dim is not None and comm.group_size(info.group) > 1 and self.tp_mode != "blockwise"
        shape = list(u.shape)
        if split:
            shape[info.dim] *= comm.group_size(info.group)
        out, inp = (shape[-1], shape[-2]) if info.transposed else (shape[-2], shape[-1])
        factor = scale_factor(out, inp, self.mode) * self.extra
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.precision)
        try:
            if not split:
                o = newton_schulz(u, self.steps, bf16=self.bf16)
            elif self.tp_mode == "duplicated":
                o = self._gathered(u, info)
            else:  # distributed: the split dim last (the one X X^T sums over), then all-reduce
                o = newton_schulz(u, self.steps, group=info.group, transpose=info.dim == u.dim() - 2, bf16=self.bf16)
        finally:
            torch.set_float32_matmul_precision(previous)
        return o * factor

    def _gathered(self, u: torch.Tensor, info: MuonMatrix) -> torch.Tensor:
        size, rank = comm.group_size(info.group), comm.group_rank(info.group)
        parts = [torch.empty_like(u) for _ in range(size)]
        dist.all_gather(parts, u.contiguous(), group=info.group)
        whole = newton_schulz(torch.cat(parts, dim=info.dim), self.steps, bf16=self.bf16)
        return whole.chunk(size, dim=info.dim)[rank].contiguous()


class MuonAdamW(torch.optim.Optimizer):
    """One torch optimizer over the run's param groups: tensors in ``matrices`` (``{tensor: MuonMatrix}``)
    take Muon steps (state ``momentum_buffer``), the others AdamW steps (``step``, ``exp_avg``,
    ``exp_avg_sq``: a ``torch.optim.AdamW`` sharing this optimizer's state and hyper-parameters)."""

    def __init__(self, groups, matrices: dict, optim_config, fused: bool):
        o = optim_config
        super().__init__(groups, dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=0.0,
                                      muon_momentum=o.muon_momentum, muon_nesterov=o.muon_use_nesterov))
        self.matrices = matrices
        self.orthogonalize = Orthogonalizer(o)
        adam_groups = [dict(g, params=[p for p in g["params"] if p not in matrices]) for g in self.param_groups]
        self.adam = torch.optim.AdamW(adam_groups, lr=o.lr, fused=fused) if any(
            g["params"] for g in adam_groups) else None
        self._link()

    def _link(self) -> None:
        if self.adam is None:
            return
        self.adam.state = self.state
        if self.adam.defaults.get("fused"):  # the fused kernel wants its step counts fp32 beside the params
            for group in self.adam.param_groups:
                for p in group["params"]:
                    step = self.state.get(p, {}).get("step")
                    if step is not None:
                        self.state[p]["step"] = step.to(p.device, torch.float32)

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    def state_keys_of(self, tensor) -> tuple[str, ...]:
        """The per-element state keys of ``tensor`` (Muon's buffer, or Adam's moments)."""
        return ("momentum_buffer",) if tensor in self.matrices else ("exp_avg", "exp_avg_sq")

    @torch.no_grad()
    def step(self, closure=None):
        if self.adam is not None:
            for mine, theirs in zip(self.param_groups, self.adam.param_groups):
                theirs.update({k: v for k, v in mine.items() if k != "params"}, params=theirs["params"])
            self.adam.step()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p in self.matrices:
                    self._muon_step(p, group)

    def _muon_step(self, p: torch.Tensor, group: dict) -> None:
        lr, wd, m = group["lr"], group["weight_decay"], group["muon_momentum"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf, grad = state["momentum_buffer"], p.grad.to(p.dtype)
        if wd:
            p.mul_(1 - lr * wd)
        buf.lerp_(grad, 1 - m)
        u = grad.lerp(buf, m) if group["muon_nesterov"] else buf
        p.add_(self.orthogonalize(u, self.matrices[p]), alpha=-lr)


def muon_matrices(chunks, pairs, state) -> dict:
    """``{tensor to step: MuonMatrix}`` of the (model param, tensor to step) ``pairs`` that Muon steps."""
    qkv, expert_group = {}, {}
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "etp_group") and hasattr(module, "num_local_experts"):  # experts: their own TP group
                expert_group.update({id(p): module.etp_group for p in module.parameters()})
            if hasattr(module, "linear_qkv") and hasattr(module, "heads_per_group") and \
                    getattr(module.linear_qkv, "weight", None) is not None:
                d = module.head_dim
                qkv[id(module.linear_qkv.weight)] = (module.heads_per_group * d, d, d)
    names = {id(p): n for chunk in chunks for n, p in chunk.named_parameters()}
    out = {}
    for p, m in pairs:
        if not takes_muon(p, names.get(id(p), "")):
            continue
        dim = int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None
        group = expert_group.get(id(p), state.tp_group if state is not None else None)
        out[m] = MuonMatrix(dim, group, transposed=p.dim() == 3, qkv=qkv.get(id(p)))
    return out


def takes_muon(param, name: str) -> bool:
    """Whether Muon steps ``param``: a linear layer's matrix (a grouped experts' stacked ``[E, in, out]``
    weight per expert), not an embedding, the output layer, a norm or a bias."""
    if getattr(param, "is_embedding_or_output_parameter", False) or "embedding" in name:
        return False
    if getattr(param, "no_weight_decay", False):  # the grouped experts' stacked biases [E, n]
        return False
    return param.dim() == 2 or (param.dim() == 3 and name.rsplit(".", 1)[-1] in ("weight1", "weight2"))
