"""The start-up notes of a resume that cannot continue the run bit for bit, by design: one line each.

A checkpoint resumed at its own layout and micro-batch size continues bit for bit. Resumed at another
layout (a ``torch_dist`` checkpoint at any TP x PP x DP x CP x EP, a ``torch`` one at another DP or CP
size) or another ``--micro-batch-size`` (the same global batch in other pieces) it continues the same
run, but not bit for bit: gradients, norms and losses are summed in another order, so the steps follow
the uninterrupted run within floating-point rounding; and at another layout the RNG states, per rank,
do not carry over (``--no-load-rng``), so with dropout on the masks are others.

With another ``--seed`` or ``--split``: the data are drawn or split otherwise (mock data, the sample
shuffle, the cyclic order), so the resumed steps train on other samples than the uninterrupted run's.
With another ``--train-iters`` (``--train-samples``): the datasets are built for the run's length, so
the sample order may differ.

Under ``--transformer-impl transformer_engine`` with ``--fp8-recipe delayed``: Transformer Engine keeps
the amax histories and scales inside its modules, and they are not in our checkpoints, so a resumed
run starts them over (the first steps cast with fresh scales).
"""

from __future__ import annotations

from ..console import print_rank_0
from .dist import layout_of

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


def describe_layout(layout: dict) -> str:
    """``layout`` (:func:`~megatron_lite.checkpoint.dist.layout_of`'s keys) in words: ``TP2 x DP2 (4 ranks)``,
    the sizes of 1 left out but TP's, with the micro-batch size where it is given."""
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
    return (f"> note: the checkpoint was saved at {describe_layout(saved)}, this run is {describe_layout(now)}: it "
            "continues the saved run within floating-point rounding, not bit for bit (sums in another order; with "
            "dropout, other masks)")


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


# Flags that decide which samples a step reads, compared with the checkpoint's run: (config key, flag).
DATA_ORDER_FLAGS = (("seed", "--seed"), ("split", "--split"))


def data_order_note(saved: dict, config) -> str | None:
    """The note of a resume whose --seed or --split differs from the checkpoint's run's (``saved``: its
    flat config), or None."""
    flat = config.flat()
    split_used = not flat.get("mock_data") and not flat.get("train_data_path")  # --split cuts --data-path only
    differ = [f"{flag} {flat.get(key)} (the checkpoint's run: {saved[key]})" for key, flag in DATA_ORDER_FLAGS
              if saved.get(key) is not None and saved[key] != flat.get(key) and (key != "split" or split_used)]
    if not differ:
        return None
    return (f"> note: {', '.join(differ)}: the data are drawn or split otherwise, so the resumed steps read other "
            "samples than an uninterrupted run would")


def train_length_note(saved: dict, config) -> str | None:
    """The note of a resume whose --train-iters (--train-samples) differs from the checkpoint's run's:
    the datasets are built for the run's length, so the sample order may not be the one an
    uninterrupted run of this length reads; or None."""
    t = config.training
    flag, now, unit = (("--train-samples", t.train_samples, "samples") if t.train_samples is not None
                       else ("--train-iters", t.train_iters, "iterations"))
    saved_length = saved.get(flag[2:].replace("-", "_"))
    if saved_length is None or saved_length == now:
        return None
    return (f"> note: {flag} {now} differs from the checkpoint's run ({saved_length}): the sample order may "
            f"differ from that of an uninterrupted run of {now} {unit} (see \"A finished run resumed with a "
            "larger --train-iters\" in docs/checkpoints.md)")


def split_change_note(saved: dict, config) -> str | None:
    """The note of a resume at the checkpoint's pipeline size whose pipeline split (the layers each
    stage holds: --pipeline-model-parallel-layout, --decoder-first/last-pipeline-num-layers, ...)
    differs from the checkpoint's run's; or None. (Another pipeline size is the layout note's.)"""
    from ..parallel.pipeline.partition import pipeline_ranges

    now = config.flat()
    if "num_layers" not in saved or (saved.get("pipeline_model_parallel_size") or 1) != (
            now["pipeline_model_parallel_size"] or 1):
        return None
    try:
        before = pipeline_ranges(saved)
    except ValueError:
        return None
    after = pipeline_ranges(now)
    if before == after:
        return None
    return (f"> note: the checkpoint's pipeline stages held layers {_stages(before)}, this run's hold {_stages(after)}: "
            "it continues the saved run within floating-point rounding, not bit for bit (sums in another order; "
            "with dropout, other masks)")


def _stages(ranges) -> str:
    return " | ".join(", ".join(f"{lo}-{hi - 1}" if hi > lo else "none" for lo, hi in chunks) for chunks in ranges)


def print_resume_notes(saved_layout: dict, saved_flags: dict, config, state) -> None:
    """Rank 0: each note of a resume from a checkpoint saved at ``saved_layout`` with the flat flags
    ``saved_flags`` (its train length, data order, layout and micro-batch size)."""
    micro = saved_flags.get("micro_batch_size")
    saved_layout = saved_layout if micro is None else {**saved_layout, "micro_batch_size": micro}
    now = {**layout_of(state), "micro_batch_size": config.training.micro_batch_size}
    for note in (train_length_note(saved_flags, config), data_order_note(saved_flags, config),
                 layout_change_note(saved_layout, now), split_change_note(saved_flags, config)):
        if note:
            print_rank_0(note)
