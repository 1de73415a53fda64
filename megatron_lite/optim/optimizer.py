"""The optimizer wrapper: fp32 master weights, loss-scale bookkeeping, global-norm clipping.

:class:`MegatronOptimizer` wraps a ``torch.optim.AdamW`` (or SGD). What it adds:

* **Param groups.** Matrices get ``--weight-decay``; biases and norm weights get 0 (:func:`decays`).
* **fp32 master weights.** For bf16/fp16 params the torch optimizer steps an fp32 copy ("master")
  with the fp32 ``main_grad`` as its gradient, then the master is rounded back into the model
  param. fp32 params are stepped directly with ``grad = main_grad``. Adam's moments are fp32 (bf16
  between steps with ``--use-precision-aware-optimizer``: optim/precision_adam.py).
* **fp16 loss scaling.** :meth:`scale_loss` multiplies the loss before backward; :meth:`step`
  divides the gradients by the scale, checks them for inf/NaN and agrees on the answer with a
  MAX all-reduce over the model-parallel group (every TP/PP rank must skip together, or the
  replicas would diverge). An overflowing step changes nothing (no param, no Adam state) and is
  counted in ``num_skipped_steps``; the scaler then adapts (see precision/loss_scaler.py).
* **Clipping** by the true global norm (optim/clip_grads.py); the returned norm is pre-clip.
* **One pass per step.** AdamW is PyTorch's fused kernel (``fused=True``: every tensor read and
  written once, on CPU and CUDA), and the clip factor is handed to it as its ``grad_scale`` instead
  of scaling the gradients in a separate pass.

Gradients come from ``param.main_grad`` (set up by DistributedDataParallel), or ``.grad`` for a
plain module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..console import print_rank_0
from ..device import get_device
from ..parallel import comm
from ..precision.loss_scaler import build_loss_scaler
from .clip_grads import get_grad_norm, grad_of
from .muon import MuonAdamW, muon_matrices
from .param_groups import build_groups, decays, from_saved_layout, to_saved_layout
from .precision_adam import PrecisionAwareAdamW, moment_dtypes


def regroup_saved_state(torch_sd: dict, params) -> dict:
    """``torch_sd``, a torch optimizer state dict over ``params`` in weight-decay group order, as this
    version groups them. One saved before the grouped experts' stacked biases left the weight-decay
    group (it put every param of more than one dimension there) is re-indexed; others are returned as they are."""
    params = list(params)
    decay, legacy = [p for p in params if decays(p)], [p for p in params if p.dim() > 1]
    groups = torch_sd["param_groups"]
    if len(decay) == len(legacy) or len(groups[0]["params"]) != len(legacy):
        return torch_sd
    new_index = {id(p): i for i, p in enumerate(decay + [p for p in params if not decays(p)])}
    old_order = legacy + [p for p in params if p.dim() <= 1]
    state = {new_index[id(old_order[int(i)])]: v for i, v in torch_sd["state"].items()}
    no_decay = groups[-1] if len(groups) > 1 else dict(groups[0], weight_decay=0.0)
    new_groups = [dict(groups[0], params=list(range(len(decay)))),
                  dict(no_decay, params=list(range(len(decay), len(params))))]
    return {"state": state, "param_groups": [g for g in new_groups if g["params"]]}


def saved_optimizer_name(torch_sd: dict) -> str | None:
    """Which ``--optimizer`` wrote ``torch_sd`` (a torch optimizer state dict): adam or sgd, from its
    param groups' hyper-parameters (Adam's ``betas``, SGD's ``momentum``); None when neither shows."""
    group = (torch_sd.get("param_groups") or [{}])[0]
    if "muon_momentum" in group:
        return "muon"
    return "adam" if "betas" in group else "sgd" if "momentum" in group else None


def hyper_changes(saved: dict, run: dict) -> list[str]:
    """The optimizer flags whose value in this run (param group ``run``) differs from the checkpoint's
    (its saved param group ``saved``), as ``--adam-beta2 0.95 (checkpoint 0.999)``."""
    pairs = list(zip(("--adam-beta1", "--adam-beta2"), saved.get("betas", ()), run.get("betas", ())))
    pairs += [(flag, saved[key], run[key]) for key, flag in (("eps", "--adam-eps"), ("momentum", "--sgd-momentum"),
                                                             ("muon_momentum", "--muon-momentum"),
                                                             ("muon_nesterov", "--muon-use-nesterov"))
              if key in saved and key in run]
    return [f"{flag} {mine} (checkpoint {theirs})" for flag, theirs, mine in pairs if float(theirs) != float(mine)]


def can_fuse(groups) -> bool:
    """Whether PyTorch's fused AdamW kernel takes these param groups (floating tensors on CPU or CUDA)."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])


def _unique_params(chunks) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for chunk in chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class MegatronOptimizer:
    """See the module docstring. Build it with :func:`megatron_lite.optim.build_optimizer`."""

    def __init__(self, chunks, state, optim_config, precision_config=None):
        self.chunks, self.state, self.config = list(chunks), state, optim_config
        self.model_params = _unique_params(self.chunks)
        self.scaler = build_loss_scaler(precision_config) if precision_config is not None else None
        self.num_skipped_steps = 0
        self.moment_dtypes = moment_dtypes(precision_config)  # --use-precision-aware-optimizer: bf16 moments
        pairs = self._make_masters()
        self.masters = [m for _, m in pairs]
        self.muon = muon_matrices(self.chunks, pairs, state) if optim_config.optimizer == "muon" else {}
        self.optimizer = self._make_torch_optimizer(self._groups(pairs))

    def _make_masters(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model param, tensor the torch optimizer steps) pairs: an fp32 copy of a 16-bit param,
        the fp32 param itself otherwise. The distributed optimizer overrides this with its shards.

        16-bit params that live in a data-parallel bucket's flat storage (``bucket.param_data``) get
        masters that are views of one fp32 copy of it (``bucket.master_data``): after the step the
        whole bucket is rounded back with one copy."""
        views, self.flat_buckets = {}, []
        for bucket in (b for chunk in self.chunks for b in getattr(chunk, "buckets", [])):
            if bucket.param_data is None or bucket.param_data.dtype == torch.float32:
                continue
            bucket.master_data = bucket.param_data.float()
            self.flat_buckets.append(bucket)
            for p in bucket.params:
                a, e = bucket.offsets[id(p)]
                views[id(p)] = bucket.master_data[a:e].view(p.shape)
        self._flat = set(views)
        return [(p, p if p.dtype == torch.float32 else views[id(p)] if id(p) in views else p.detach().float().clone())
                for p in self.model_params]

    def _groups(self, pairs) -> list[dict]:
        """Param groups over (model param, tensor to step) pairs (:mod:`megatron_lite.optim.param_groups`):
        matrices decay, biases and norms do not; ``--decoupled-lr`` parts the embedding and output layer."""
        groups, self.group_layout = build_groups(pairs, self.config)
        self.decay_groups = [decay for decay, _ in self.group_layout.flags]  # read by the scheduler
        self.decoupled_groups = [dec for _, dec in self.group_layout.flags]
        return groups

    def _make_torch_optimizer(self, groups):
        oc = self.config
        if oc.optimizer == "adam" and self.moment_dtypes:  # moments stored in bf16, updated in fp32
            return PrecisionAwareAdamW(groups, moment_dtypes=self.moment_dtypes, lr=oc.lr,
                                       betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.adam_eps, fused=can_fuse(groups))
        if oc.optimizer == "adam":  # fused: one pass over each tensor (PyTorch's CPU and CUDA kernels)
            return torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.adam_eps,
                                     fused=can_fuse(groups))
        if oc.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=oc.lr, momentum=oc.sgd_momentum)
        if oc.optimizer == "muon":  # Muon for the linear layers' matrices, AdamW (fused) for the rest
            return MuonAdamW(groups, self.muon, oc, fused=can_fuse(groups))
        raise ValueError(f"--optimizer {oc.optimizer!r}: expected adam, sgd or muon")

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    sharded = False  # stat_pairs cover whole parameters (the distributed optimizer's: this rank's pieces)

    def stat_pairs(self, grads: bool) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        """``(model param, tensor)`` for the model-wide figures of --log-params-norm and
        --log-num-zeros-in-grad: the fp32 master (what the step wrote) or, with ``grads``, the
        gradient it was stepped with (reduced over data parallelism)."""
        return [(p, grad_of(p) if grads else m) for p, m in zip(self.model_params, self.masters)]

    # loss scale ----------------------------------------------------------------------------
    def get_loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (times the fp16 loss scale; unchanged otherwise)."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def _unscale_and_check(self, grads, groups) -> bool:
        """Divide ``grads`` by the loss scale; True if any rank (MAX over ``groups``) has inf/NaN."""
        device = grads[0].device if grads else get_device()  # a rank may own no gradient (padding only)
        found = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:  # one multi-tensor pass: multiply by 1 / scale, flag any inf/NaN (GradScaler's kernel)
            inv = torch.full((1,), 1.0 / self.scaler.scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        for group in groups:
            if comm.group_size(group) > 1:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())

    # step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        """One update: (update_successful, grad_norm before clipping or None if skipped)."""
        if self.scaler is not None:
            grads = [g for g in map(grad_of, self.model_params) if g is not None]
            found_inf = self._unscale_and_check(grads, (self.state.mp_group, self.state.ep_group))
            self.scaler.update(found_inf)
            if found_inf:
                self.num_skipped_steps += 1
                return False, None
        grad_norm = get_grad_norm(self.model_params, self.state)
        for p, m in zip(self.model_params, self.masters):
            g = grad_of(p)
            m.grad = None if g is None else g.to(m.dtype)
        self._step_clipped(grad_norm, [m.grad for m in self.masters if m.grad is not None])
        for p, m in zip(self.model_params, self.masters):
            m.grad = None
            if m is not p and id(p) not in self._flat:
                p.copy_(m)
        for bucket in self.flat_buckets:  # the rest: one fp32 -> 16-bit copy per bucket
            bucket.param_data.copy_(bucket.master_data)
        return True, grad_norm

    def _step_clipped(self, grad_norm: float, grads) -> None:
        """Step the torch optimizer with ``grads`` clipped to ``--clip-grad`` (by the global norm). A fused
        AdamW takes the clip factor as its ``grad_scale`` (the kernel divides each gradient by it as it
        reads it), which saves a pass over the gradients; otherwise they are scaled in place first."""
        coeff = self.config.clip_grad / (grad_norm + 1e-6) if self.config.clip_grad > 0 else 1.0
        fused = self.optimizer.defaults.get("fused") if isinstance(self.optimizer, torch.optim.Optimizer) else False
        if coeff < 1.0 and fused:
            device = grads[0].device if grads else get_device()
            self.optimizer.grad_scale = torch.tensor(1.0 / coeff, dtype=torch.float32, device=device)
        elif coeff < 1.0:
            for g in grads:
                g.mul_(coeff)
        try:
            self.optimizer.step()
        finally:
            self.optimizer.grad_scale = None

    def zero_grad(self) -> None:
        """Zero the DDP grad buffers (``main_grad``) and drop any ``.grad``."""
        for chunk in self.chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        for p, m in zip(self.model_params, self.masters):
            p.grad = None
            m.grad = None

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model params (after loading weights without optimizer state)."""
        for p, m in zip(self.model_params, self.masters):
            if m is not p:
                m.copy_(p)

    # checkpoint ----------------------------------------------------------------------------
    def note_saved_hyper(self, saved_group: dict) -> None:
        """After loading optimizer state: the hyper-parameters stay this run's (its --adam-beta1/2,
        --adam-eps, --sgd-momentum, kernel; lr and weight decay are the schedule's), not those the
        checkpoint's param groups carry; say which flags differ from the checkpoint's."""
        changes = hyper_changes(saved_group, self.optimizer.param_groups[0])
        if changes:
            print_rank_0(f"> optimizer flags that differ from the checkpoint's, this run's used: {', '.join(changes)}")

    def shard_slots(self) -> list[tuple[torch.nn.Parameter, torch.Tensor, int, int]]:
        """``(model param, tensor the torch optimizer steps, lo, hi)``: the flat range ``[lo, hi)`` of
        each model param whose optimizer state this rank holds (all of it here). The sharded
        checkpoint format saves and loads the state slot by slot, without gathering it."""
        return [(p, m, 0, p.numel()) for p, m in zip(self.model_params, self.masters)]

    def state_dict(self) -> dict:
        """Adam state, fp32 masters, loss scaler, skip count (tensors are references, as in torch)."""
        separate = any(m is not p for p, m in zip(self.model_params, self.masters))
        return {
            "optimizer": to_saved_layout(self.optimizer.state_dict(), self.group_layout),
            "fp32_masters": [m.detach() for m in self.masters] if separate else None,
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "num_skipped_steps": self.num_skipped_steps,
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Restore everything; the masters (when saved) also overwrite the model params."""
        saved = regroup_saved_state(sd["optimizer"], self.model_params)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(from_saved_layout(saved, self.group_layout))
        for group, mine in zip(self.optimizer.param_groups, hyper):  # torch's load took the saved ones
            group.update(mine)
        self.note_saved_hyper(saved["param_groups"][0])
        masters = sd.get("fp32_masters")
        if masters is not None:
            if len(masters) != len(self.masters):
                raise ValueError(
                    f"optimizer checkpoint holds {len(masters)} master weights but the model has "
                    f"{len(self.masters)} parameters; was it saved with a different model or parallel layout?"
                )
            for p, m, saved in zip(self.model_params, self.masters, masters):
                m.copy_(saved)
                if m is not p:
                    p.copy_(m)
        else:
            self.reload_model_params()
        if self.scaler is not None and sd.get("loss_scaler") is not None:
            self.scaler.load_state_dict(sd["loss_scaler"])
        self.num_skipped_steps = int(sd.get("num_skipped_steps", 0))

