"""The start-up notes of a resume that cannot continue the run bit for bit, by design: one line each.

At another parallel layout, or another ``--micro-batch-size`` (the same global batch in other pieces):

A checkpoint resumed at its own layout continues bit for bit. Resumed at another one (a ``torch_dist``
checkpoint at any TP x PP x DP x CP x EP, a ``torch`` one at another DP or CP size) it continues the
same run, but not bit for bit: gradients, norms and losses are summed over other groups in another
order, so the steps follow the uninterrupted run within floating-point rounding; and the RNG states,
per rank, do not carry over (``--no-load-rng``), so with dropout on the masks are others. The
resume says so once, as a note.

Under ``--transformer-impl transformer_engine`` with ``--fp8-recipe delayed``: Transformer Engine keeps
the amax histories and scales inside its modules, and they are not in our checkpoints, so a resumed
run starts them over (the first steps cast with fresh scales).
"""

from __future__ import annotations

# (key of a torch_dist checkpoint's "layout" and of dist.layout_of, key of a torch model file, its name)
_SIZES = (("tp", "tp_size", "TP"), ("pp", "pp_size", "PP"), ("dp", "dp_size", "DP"), ("cp", "cp_size", "CP"),
          ("ep", "ep_size", "EP"), ("etp", "etp_size", "ETP"), ("vpp", "vpp_size", "VPP"))


def torch_file_layout(ckpt: dict) -> dict:
    """The layout a ``torch`` model file was saved at, in :func:`~megatron_lite.checkpoint.dist.layout_of`'s
    keys (those the file records; its world size stands for the CP size it does not record)."""
    out = {key: ckpt[field] for key, field, _ in _SIZES if ckpt.get(field) is not None}
    if not ckpt.get("expert_grid_folded"):  # an unfolded grid's expert TP is its TP (layout_of leaves it out)
        out.pop("etp", None)
    if ckpt.get("world_size") is not None:
        out["world_size"] = ckpt["world_size"]
    return out


def _describe(layout: dict) -> str:
    sizes = " x ".join(f"{name}{layout[key]}" for key, _, name in _SIZES if (layout.get(key) or 1) != 1 or key == "tp")
    ranks = f" ({layout['world_size']} ranks)" if "world_size" in layout else ""
    micro = f", micro-batch size {layout['micro_batch_size']}" if "micro_batch_size" in layout else ""
    return sizes + ranks + micro


def layout_change_note(saved: dict, now: dict) -> str | None:
    """The note for a checkpoint saved at layout ``saved`` resumed at ``now`` (both as
    :func:`~megatron_lite.checkpoint.dist.layout_of` gives them, with ``micro_batch_size`` where known;
    only the sizes ``saved`` records are compared), or None at the same layout and micro-batch size."""
    if all((now.get(key) or 1) == (value or 1) for key, value in saved.items()):
        return None
    return (f"> note: the checkpoint was saved at {_describe(saved)}, this run is {_describe(now)}: it continues the "
            "saved run within floating-point rounding, not bit for bit (sums in another order; with dropout, other "
            "masks)")


def transformer_engine_note(precision) -> str | None:
    """The note of a resume whose FP8 scaling state Transformer Engine held (``precision``: the
    config's precision section), or None when our checkpoints hold it (or there is none)."""
    if precision.transformer_impl != "transformer_engine" or precision.fp8_format is None:
        return None
    if precision.fp8_recipe != "delayed":  # the current and block-scaled recipes keep no state across steps
        return None
    return ("> note: --transformer-impl transformer_engine keeps the delayed-scaling FP8 amax histories and scales "
            "inside Transformer Engine, not in checkpoints: they start over here, so this resumed run is not bit for "
            "bit the uninterrupted one")
