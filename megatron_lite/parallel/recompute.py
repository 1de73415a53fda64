"""Selective recomputation (``--recompute-granularity selective --recompute-modules ...``).

Megatron-LM's module names say which parts of each transformer layer keep nothing for backward and
run again in it (the default is ``core_attn``):

* ``core_attn``: QK^T, softmax, dropout, @V (:func:`megatron_lite.parallel.random.checkpoint`, which
  replays the dropout masks);
* ``mlp``: the dense MLP of a layer (fc1, activation, fc2); the MoE layers are ``moe``'s;
* ``moe``: the whole MoE layer (router, dispatch, experts, combine, shared experts); its aux losses,
  token counts and dropped-token counts are recorded once, by the recomputation (as under full
  recomputation);
* ``moe_act``: the experts' activation (times the routing probabilities): its output, fc2's input, is
  freed after fc2's forward and computed again just before fc2's backward;
* ``shared_experts``: the shared experts' MLP;
* ``layernorm``: the two norms (``input_norm``, ``pre_mlp_norm``): each output is freed once the
  attention / MLP forward that reads it has run and computed again just before that part's backward,
  so neither the norm's statistics nor its output (the QKV and fc1 input) stay alive;
* ``mla_up_proj``: multi-latent attention's up projections, rotary embedding and the concatenation
  into per-head queries, keys and values, together with the core attention they feed (so Q, K and V
  are not kept).

``moe_act`` and ``layernorm`` use :class:`DiscardedOutput`: the function runs without a graph, its
output's storage is released after the consumer's forward, and a hook on the consumer's output
gradient refills the same storage (without a version bump, so the consumer's saved reference stays
valid) before the consumer's backward reads it.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..moe.config import moe_layer_pattern

RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "shared_experts", "layernorm", "mla_up_proj")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)


def recompute_modules(config) -> frozenset[str]:
    """The modules ``config`` recomputes selectively (empty unless the granularity is selective)."""
    if config.recompute_granularity != "selective":
        return frozenset()
    modules = config.recompute_modules
    return frozenset(DEFAULT_RECOMPUTE_MODULES if modules is None else modules)


def check_recompute_modules(config) -> None:
    """Refuse names we do not know, modules the model lacks, and the flag without selective recomputation."""
    modules = config.recompute_modules
    if modules is None:
        return
    if config.recompute_granularity != "selective":
        raise ConfigError("--recompute-modules only applies with --recompute-granularity selective; add it, or "
                          "drop --recompute-modules")
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ConfigError(f"--recompute-modules {' '.join(unknown)}: unknown module; choose from "
                          f"{', '.join(RECOMPUTE_MODULES)}")
    experts = bool(getattr(config, "num_experts", None))
    needs = {"moe": (experts, "--num-experts"), "moe_act": (experts, "--num-experts"),
             "shared_experts": (experts and bool(getattr(config, "moe_shared_expert_intermediate_size", None)),
                                "--moe-shared-expert-intermediate-size"),
             "mla_up_proj": (bool(getattr(config, "multi_latent_attention", False)), "--multi-latent-attention")}
    for name in modules:
        present, flag = needs.get(name, (True, ""))
        if not present:
            raise ConfigError(f"--recompute-modules {name} needs a model with {flag}; drop {name}")
    pattern = moe_layer_pattern(config) if experts and not getattr(config, "spec", None) else None
    if "mlp" in modules and pattern and all(pattern):
        raise ConfigError(f"--recompute-modules mlp recomputes dense MLPs and every layer is an MoE layer "
                          f"(--moe-layer-freq {config.moe_layer_freq}); drop mlp, or use moe or moe_act")
    moe_parts = [m for m in modules if m in ("moe", "moe_act", "shared_experts")]
    if moe_parts and pattern and not any(pattern):
        raise ConfigError(f"--recompute-modules {' '.join(moe_parts)} recomputes MoE layers and no layer is one "
                          f"(--moe-layer-freq {config.moe_layer_freq}); drop {' '.join(moe_parts)}, or use mlp")
    if "moe" in modules and "moe_act" in modules:
        raise ConfigError("--recompute-modules moe already recomputes the experts' activation; drop moe_act")
    if "moe" in modules and "shared_experts" in modules:
        raise ConfigError("--recompute-modules moe already recomputes the shared experts; drop shared_experts")


class _Discarded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, holder, *args):
        ctx.holder = holder
        with torch.no_grad():
            out = holder.fn(*args)
        ctx.save_for_backward(*args)
        return out

    @staticmethod
    def backward(ctx, grad):
        holder = ctx.holder
        if holder.recomputed is None:  # the consumer's hook did not run (its output got no gradient)
            holder.recompute(ctx.saved_tensors)
        inputs, out = holder.recomputed
        holder.recomputed = None
        torch.autograd.backward(out, grad)
        return (None,) + tuple(x.grad if x.requires_grad else None for x in inputs)


class DiscardedOutput:
    """``run(fn, *tensors)`` computes ``fn(*tensors)`` keeping only the inputs for backward;
    ``discard(consumer_output)`` then frees the output's storage and arranges for it to be computed
    again when ``consumer_output``'s gradient arrives (module docstring). ``fn`` must be deterministic
    (no dropout) and return one fresh tensor."""

    def __init__(self, fn):
        self.fn, self.storage, self.recomputed, self.saved = fn, None, None, None

    def run(self, *args: torch.Tensor) -> torch.Tensor:
        output = _Discarded.apply(self, *args)
        # the storage, not the tensor: the tensor holds its grad_fn, whose context holds this holder, and
        # that cycle would keep the refilled output alive after backward until the garbage collector runs
        self.storage, self.saved = output.untyped_storage(), args
        return output

    def recompute(self, inputs) -> None:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        with torch.enable_grad():
            out = self.fn(*inputs)
        self.recomputed = (inputs, out)
        storage = self.storage
        if storage.size() == 0:  # refill the freed storage in place: the consumer saved this tensor
            storage.resize_(out.untyped_storage().size())
            storage.copy_(out.untyped_storage())

    def discard(self, consumer_output: torch.Tensor) -> None:
        inputs, self.saved = self.saved, None
        self.storage.resize_(0)
        consumer_output.register_hook(lambda grad: self._on_grad(inputs, grad))

    def _on_grad(self, inputs, grad):
        if self.recomputed is None:
            self.recompute(inputs)
        return grad


def run_discarding(fn, *args: torch.Tensor):
    """``(output, holder)``: ``fn(*args)`` through a :class:`DiscardedOutput` when a graph is being
    built (``holder`` then needs ``discard(consumer_output)``), else a plain call (holder None)."""
    if not torch.is_grad_enabled() or not any(a.requires_grad for a in args):
        return fn(*args), None
    holder = DiscardedOutput(fn)
    return holder.run(*args), holder
