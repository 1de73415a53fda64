"""The optimizer's parameter groups: weight decay or not, and with ``--decoupled-lr`` the input
embedding and output layer apart from the rest.

Groups, in this order, empty ones left out: decaying, decaying with the decoupled lr, not decaying,
not decaying with the decoupled lr. :func:`group_flags` says which decay and which take the
decoupled lr (read by :class:`~megatron_lite.optim.lr_scheduler.OptimizerParamScheduler`).

A checkpoint keeps the two-group layout (decaying params first, in model order, then the others)
whatever the grouping here, so checkpoints, the converter and the sharded formats do not depend on
``--decoupled-lr``: :func:`to_saved_layout` and :func:`from_saved_layout` translate the torch
optimizer's state dict.
"""

from __future__ import annotations

from ..errors import ConfigError


def decays(param) -> bool:
    """Whether ``--weight-decay`` applies to ``param``: to matrices, not to biases and norm weights (as
    in Megatron). Those are 1-D, except the grouped experts' stacked biases ``[E, n]``, which are
    marked ``no_weight_decay`` (a sequential expert's own bias is 1-D and does not decay either)."""
    return param.dim() > 1 and not getattr(param, "no_weight_decay", False)


def decoupled(param, config) -> bool:
    """Whether ``param`` takes ``--decoupled-lr``: the word embedding and output layer weights (the
    models mark them ``is_embedding_or_output_parameter``), when the flag is given."""
    return getattr(config, "decoupled_lr", None) is not None and getattr(param, "is_embedding_or_output_parameter",
                                                                          False)


def check_decoupled_lr(o) -> None:
    """--decoupled-min-lr needs --decoupled-lr; both at least 0, the floor not above the peak."""
    if o.decoupled_lr is None:
        if o.decoupled_min_lr is not None:
            raise ConfigError("--decoupled-min-lr needs --decoupled-lr (the embedding and output layer's peak lr)")
        return
    if o.decoupled_lr < 0:
        raise ConfigError(f"--decoupled-lr must be at least 0, got {o.decoupled_lr}")
    floor = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
    if not 0 <= floor <= o.decoupled_lr:
        flag = "--min-lr" if o.decoupled_min_lr is None else "--decoupled-min-lr"
        raise ConfigError(f"{flag} {floor} must be in [0, --decoupled-lr {o.decoupled_lr}]; set --decoupled-min-lr")


class GroupLayout:
    """Each group's (decays, decoupled lr) flags and size, and for each tensor in group order its
    index in the saved two-group layout."""

    def __init__(self, flags: list[tuple[bool, bool]], sizes: list[int], saved_index: list[int]):
        self.flags, self.sizes, self.saved_index = flags, sizes, saved_index
        self.regrouped = any(dec for _, dec in flags)  # else the groups are the saved layout already


def build_groups(pairs, config) -> tuple[list[dict], GroupLayout]:
    """The torch param groups over (model param, tensor to step) pairs, and their :class:`GroupLayout`."""
    saved_order = [i for i, (p, _) in enumerate(pairs) if decays(p)] + [i for i, (p, _) in enumerate(pairs)
                                                                        if not decays(p)]
    saved_index_of = {i: k for k, i in enumerate(saved_order)}
    wd = config.weight_decay
    groups, flags, sizes, saved_index = [], [], [], []
    for decay in (True, False):
        for dec in (False, True):
            members = [i for i, (p, _) in enumerate(pairs) if decays(p) == decay and decoupled(p, config) == dec]
            if members:
                groups.append({"params": [pairs[i][1] for i in members], "weight_decay": wd if decay else 0.0})
                flags.append((decay, dec))
                sizes.append(len(members))
                saved_index += [saved_index_of[i] for i in members]
    return groups, GroupLayout(flags, sizes, saved_index)


def to_saved_layout(torch_sd: dict, layout: GroupLayout) -> dict:
    """A torch optimizer state dict over the groups of :func:`build_groups`, in the two-group layout."""
    if not layout.regrouped:
        return torch_sd
    state = {layout.saved_index[int(i)]: v for i, v in torch_sd["state"].items()}
    groups, start = [], 0
    for decay in (True, False):
        mine = [(g, n) for g, n, (d, _) in zip(torch_sd["param_groups"], layout.sizes, layout.flags) if d == decay]
        count = sum(n for _, n in mine)
        if count:
            groups.append(dict(mine[0][0], params=list(range(start, start + count))))
            start += count
    return {"state": state, "param_groups": groups}


def from_saved_layout(torch_sd: dict, layout: GroupLayout) -> dict:
    """The inverse of :func:`to_saved_layout`: each saved group's hyper-parameters go to its groups here."""
    if not layout.regrouped:
        return torch_sd
    internal = {k: i for i, k in enumerate(layout.saved_index)}
    state = {internal[int(k)]: v for k, v in torch_sd["state"].items()}
    saved = torch_sd["param_groups"]
    groups, start = [], 0
    for (decay, _), size in zip(layout.flags, layout.sizes):
        hyper = saved[0] if decay or len(saved) == 1 else saved[-1]
        groups.append(dict(hyper, params=list(range(start, start + size))))
        start += size
    return {"state": state, "param_groups": groups}
