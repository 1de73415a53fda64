"""Training-loop hooks of the MoE routers: aux-loss gradient scale, logged losses, per-step updates.

Routers keep their state on themselves (no globals); these functions find every
:class:`~megatron_lite.moe.router.TopKRouter` in the model chunks of this rank.

Logged values follow Megatron's reduction: per loss name a vector over the global layers, each
micro-batch adding ``loss / coeff`` at its layer; at log time it is summed over pipeline stages,
summed over the ranks holding partial losses of one micro-batch (tensor x context parallel; for
the global loss also data parallel), averaged over data x context parallel, divided by the number
of micro-batches. The console value is the mean over the MoE layers. Multi-token prediction's
layers (global numbers ``num_layers + k``) count as layers of the last layer's kind, as in Megatron-LM.
The auxiliary losses that modules of a ``--spec`` log (an ``aux_losses`` dict) are reduced the same
way (:func:`plugin_loss_values`).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..device import get_device
from ..parallel import comm
from .aux_loss import LOSS_NAMES
from .layer_pattern import parse_moe_layer_freq
from .router import TopKRouter, balancing_types


def routers(chunks) -> list[TopKRouter]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def set_aux_loss_backward_scale(chunks, scale: float) -> None:
    """The gradient auxiliary losses receive: what the main loss is multiplied by before backward
    (loss scale / number of micro-batches, times the context-parallel size). Set on every module
    with an ``aux_loss_backward_scale`` attribute: the routers, and any module of a layer spec that
    attaches a loss of its own with :func:`~megatron_lite.moe.aux_loss.attach_loss`."""
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "aux_loss_backward_scale"):
                module.aux_loss_backward_scale = scale


def tracked_loss_names(config) -> list[str]:
    """The loss names the routers of ``config`` log (the same on every rank, MoE layers or not)."""
    names = [LOSS_NAMES[kind] for kind, coeff in balancing_types(config) if kind in LOSS_NAMES and coeff]
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def _sum(x: torch.Tensor, *groups) -> torch.Tensor:
    for group in groups:
        x = comm.reduce_from_tp(x, group)
    return x


def reduce_moe_losses(chunks, state, names: list[str], num_layers: int, num_microbatches: int) -> dict[str, torch.Tensor]:
    """``{name: [num_layers] tensor}`` of the iteration's logged losses (collective; see module doc).
    Resets the routers' accumulators."""
    found = routers(chunks)
    device = next((r.weight.device for r in found), get_device())
    out = {}
    for name in names:
        values = torch.zeros(num_layers, dtype=torch.float32, device=device)
        for router in found:
            if name in router.metrics:
                values[router.layer_number - 1] += router.metrics[name].to(device)
        partial_groups = (state.tp_group, state.dp_cp_group) if name.startswith("global") else (state.group("tp_cp"),)
        with torch.no_grad():
            values = _sum(values, state.pp_group, *partial_groups)
            values = _sum(values, state.dp_cp_group) / comm.group_size(state.dp_cp_group)
        out[name] = values / num_microbatches
    for router in found:
        router.metrics = {}
    return out


def moe_log_values(per_layer: dict[str, torch.Tensor], num_moe_layers: int) -> dict[str, float]:
    """The console scalars: each loss averaged over the MoE layers."""
    return {name: float(values.sum()) / max(num_moe_layers, 1) for name, values in per_layer.items()}


def dropped_tokens(chunks, state) -> int:
    """Token slots dropped by the capacity limit since the last call, over all layers and ranks."""
    found = routers(chunks)
    local = torch.tensor(float(sum(r.num_dropped_tokens for r in found)), device=get_device())
    for router in found:
        router.num_dropped_tokens = 0
    with torch.no_grad():
        total = _sum(local, state.pp_group, state.tp_group, state.dp_cp_group)
    return int(total.item())


def moe_step_values(chunks, state, config, num_microbatches: int) -> tuple[dict[str, float], dict[str, float]]:
    """For the training loop (collective, every rank, every iteration): the console values
    ``{name: mean over MoE layers}`` and TensorBoard-only scalars (``moe/<name>_layer_<i>`` with
    --moe-per-layer-logging, ``moe/dropped_tokens`` with a capacity factor). ``config`` is the run's Config."""
    moe, num_layers = config.moe, config.model.num_layers
    pattern = parse_moe_layer_freq(moe.moe_layer_freq, num_layers)
    mtp = config.model.mtp_num_layers or 0  # multi-token prediction layers: after the last, of its kind
    pattern, num_layers = pattern + pattern[-1:] * mtp, num_layers + mtp
    per_layer = reduce_moe_losses(chunks, state, tracked_loss_names(moe), num_layers, num_microbatches)
    scalars = {}
    if moe.moe_per_layer_logging:
        for name, values in per_layer.items():
            scalars.update({f"moe/{name}_layer_{i}": float(values[i]) for i in range(num_layers) if pattern[i]})
    if moe.moe_expert_capacity_factor is not None:
        scalars["moe/dropped_tokens"] = float(dropped_tokens(chunks, state))
    return moe_log_values(per_layer, sum(pattern)), scalars


# The auxiliary-loss names a --spec's modules log, per model (keyed by the first chunk; the same on
# every rank): learned by one exchange of names, and again only when a rank logs a name outside them.
_PLUGIN_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _all_names(local: set[str]) -> list[str]:
    """Every rank's names (collective over the world; only when some rank logs a name not yet known)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(local))
        local = set().union(*every)
    return sorted(local)


def _reduce_plugin_losses(found, state, names: list[str], new_here: bool):
    """Per name: (the loss summed over pp and TP x CP, then over DP x CP; the number of modules on
    this pipeline column that log it; whether any rank logs it), and whether any rank logs a name
    outside ``names``. Tensor collectives only: three all-reduces of one vector, whatever the names."""
    device = get_device()
    values, counts = [], []
    for name in names:
        held = [m.aux_losses[name] for m in found if name in m.aux_losses]
        values.append(torch.stack([v.detach().float().reshape(()).to(device) for v in held]).sum() if held
                      else torch.zeros((), dtype=torch.float32, device=device))
        counts.append(float(len(held)))
    k = len(names)
    counts = torch.tensor(counts + [1.0 if new_here else 0.0], dtype=torch.float32, device=device)
    with torch.no_grad():  # layout: values[k], counts[k] (summed over pp only), held anywhere[k], new name[1]
        vector = _sum(torch.cat([torch.stack(values) if values else counts[:0], counts[:k], counts]), state.pp_group)
        rest = torch.cat([vector[:k], vector[2 * k:]])
        rest = _sum(rest, state.group("tp_cp"), state.dp_cp_group)
    out = torch.cat([rest[:k], vector[k:2 * k], rest[k:]]).tolist()  # one copy to the host
    return out[:k], out[k:2 * k], [x > 0 for x in out[2 * k:3 * k]], out[-1] > 0


def plugin_loss_values(chunks, state, num_microbatches: int) -> dict[str, float]:
    """The console values of the auxiliary losses that modules of a ``--spec`` log (collective, every
    rank, every iteration of a run with --spec): a module other than a router that holds an
    ``aux_losses`` dict (name -> this rank's partial, summed over the step's micro-batches; the
    partials of the TP x CP ranks of a micro-batch sum to its loss) is reduced as the routers' losses
    are: summed over pipeline stages and TP x CP, averaged over DP x CP, divided by the micro-batches,
    averaged over the modules that log the name. A name is reported on the steps some rank logs it.
    Resets the dicts. The names are exchanged (``all_gather_object``) only on a step where some rank
    logs one not seen before in this model (the first step of a run whose spec logs any); the values
    travel in one tensor with a flag that tells every rank when that happens."""
    found = [m for chunk in chunks for m in chunk.modules()
             if isinstance(getattr(m, "aux_losses", None), dict) and not isinstance(m, TopKRouter)]
    local = {name for m in found for name in m.aux_losses}
    names = _PLUGIN_NAMES.get(chunks[0], [])
    values, counts, logged, new_somewhere = _reduce_plugin_losses(found, state, names, bool(local - set(names)))
    if new_somewhere:  # every rank sees the flag: learn the names, then reduce again with them
        names = _PLUGIN_NAMES[chunks[0]] = _all_names(local | set(names))
        values, counts, logged, _ = _reduce_plugin_losses(found, state, names, False)
    size = comm.group_size(state.dp_cp_group)
    out = {name: value / size / num_microbatches / max(count, 1.0)
           for name, value, count, here in zip(names, values, counts, logged) if here}
    for module in found:
        module.aux_losses = {}
    return out


def finish_moe_step(chunks) -> None:
    """After the optimizer step: expert-bias updates and per-step counters (collective over TP x DP x CP)."""
    for router in routers(chunks):
        router.finish_step()
