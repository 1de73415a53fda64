"""Which global transformer layers each pipeline rank (and each of its model chunks) holds.

:func:`pipeline_ranges` is the one place every consumer (model building, checkpoints and their
resharding, the converter, the flag checks, the parallel state's virtual size) gets them from, for
every way of splitting: even, --decoder-first/last-pipeline-num-layers, interleaved
(--num-layers-per-virtual-pipeline-stage), --account-for-embedding/loss-in-pipeline-split and
--pipeline-model-parallel-layout (:mod:`.layout`).
"""

from __future__ import annotations

from collections.abc import Mapping

from .layout import layout_ranges


def _split_evenly(layers: int, stages: int, what: str) -> list[int]:
    if stages == 0:
        if layers:
            raise ValueError(f"{what}: {layers} layers are left over but no pipeline stage remains to hold them")
        return []
    if layers < 0 or layers % stages:
        raise ValueError(f"{what}: {layers} remaining layers cannot be split evenly over {stages} stages")
    return [layers // stages] * stages


def layer_ranges(num_layers: int, pp_size: int, vpp_layers: int | None = None,
                 first: int | None = None, last: int | None = None) -> list[list[tuple[int, int]]]:
    """``[pp_rank][chunk] -> (layer_start, layer_end)``, global layer numbers, end exclusive.

    - Even split: each of the ``pp_size`` ranks holds ``num_layers / pp_size`` consecutive layers.
    - ``first`` / ``last`` (--decoder-first/last-pipeline-num-layers): the first / last stage holds
      that many layers, the remaining stages split the rest evenly.
    - ``vpp_layers`` (--num-layers-per-virtual-pipeline-stage): interleaved; each rank holds
      ``v = num_layers / (pp_size * vpp_layers)`` chunks and chunk ``c`` of rank ``r`` holds layers
      ``[(c * pp_size + r) * vpp_layers, ... + vpp_layers)`` (Megatron's assignment), so the
      virtual stages run round-robin over the ranks.
    Raises ValueError naming the flags when the layers do not divide.
    """
    if pp_size < 1 or num_layers < 1:
        raise ValueError(f"--num-layers {num_layers} and --pipeline-model-parallel-size {pp_size} must be positive")
    if vpp_layers is not None:
        if first is not None or last is not None:
            raise ValueError(
                "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers; use one or the other"
            )
        if vpp_layers < 1 or num_layers % (pp_size * vpp_layers):
            raise ValueError(
                f"--num-layers {num_layers} is not divisible by --num-layers-per-virtual-pipeline-stage "
                f"{vpp_layers} x --pipeline-model-parallel-size {pp_size}; change one of them"
            )
        chunks = num_layers // (pp_size * vpp_layers)
        return [
            [((c * pp_size + r) * vpp_layers, (c * pp_size + r + 1) * vpp_layers) for c in range(chunks)]
            for r in range(pp_size)
        ]
    if first is None and last is None:
        if num_layers % pp_size:
            raise ValueError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp_size}; change "
                "one, or set --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
            )
        counts = [num_layers // pp_size] * pp_size
    else:
        what = (
            f"--decoder-first-pipeline-num-layers {first} / --decoder-last-pipeline-num-layers {last} with "
            f"--num-layers {num_layers} and --pipeline-model-parallel-size {pp_size}"
        )
        for value in (first, last):
            if value is not None and value < 0:
                raise ValueError(f"{what}: layer counts must not be negative")
        if pp_size == 1:
            raise ValueError(f"{what}: explicit first/last stage layers need --pipeline-model-parallel-size > 1")
        fixed = (first or 0) + (last or 0)
        middle = pp_size - (first is not None) - (last is not None)
        rest = _split_evenly(num_layers - fixed, middle, what)
        counts = ([first] if first is not None else []) + rest + ([last] if last is not None else [])
        empty = [str(r) for r in range(1, pp_size - 1) if counts[r] == 0]
        if empty:  # the first and last stages hold the embedding and the output layer; a middle one holds nothing
            raise ValueError(f"{what}: pipeline stage{'s' * (len(empty) > 1)} {', '.join(empty)} would hold no layers "
                             "and no parameters; give every middle stage at least one layer")
    out, start = [], 0
    for count in counts:
        out.append([(start, start + count)])
        start += count
    return out


def num_chunks(num_layers: int, pp_size: int, vpp_layers: int | None = None) -> int:
    """Model chunks per rank: 1 without interleaving, else num_layers / (pp_size * vpp_layers)."""
    return 1 if vpp_layers is None else len(layer_ranges(num_layers, pp_size, vpp_layers)[0])


ACCOUNT_FLAGS = {"embedding": "--account-for-embedding-in-pipeline-split",
                 "loss": "--account-for-loss-in-pipeline-split"}


def accounted_ranges(num_layers: int, pp_size: int, vpp_layers: int | None, embedding: bool,
                     loss: bool) -> list[list[tuple[int, int]]]:
    """Megatron-LM's --account-for-embedding/loss-in-pipeline-split: the even split counts the
    embedding as one more layer before the first, the loss (the output layer) as one after the
    last; ``num_layers + embedding + loss`` slots split evenly over the stages (``vpp_layers``
    slots per virtual stage when interleaved), so 6 layers + 2 over PP 4 give 1, 2, 2, 1."""
    used = " and ".join(flag for flag, on in ((ACCOUNT_FLAGS["embedding"], embedding),
                                               (ACCOUNT_FLAGS["loss"], loss)) if on)
    total = num_layers + embedding + loss
    if vpp_layers is None:
        if total % pp_size:
            raise ValueError(f"--num-layers {num_layers} + {total - num_layers} ({used}) = {total} is not divisible by "
                             f"--pipeline-model-parallel-size {pp_size}; change --num-layers or the pipeline size")
        per = total // pp_size
    else:
        if vpp_layers < 1 or total % (pp_size * vpp_layers):
            raise ValueError(f"--num-layers {num_layers} + {total - num_layers} ({used}) = {total} is not divisible by "
                             f"--num-layers-per-virtual-pipeline-stage {vpp_layers} x --pipeline-model-parallel-size "
                             f"{pp_size}; change one of them")
        per = vpp_layers
    out: list[list[tuple[int, int]]] = [[] for _ in range(pp_size)]
    for s in range(total // per):  # virtual stage s: slots [s * per, (s + 1) * per), slot 0 the embedding's
        lo, hi = (min(max(slot - embedding, 0), num_layers) for slot in (s * per, (s + 1) * per))
        out[s % pp_size].append((lo, hi))
    return out


def pipeline_ranges(flags: Mapping) -> list[list[tuple[int, int]]]:
    """``[pp_rank][chunk] -> (layer_start, layer_end)`` from a flat config (``Config.flat()``, or a
    checkpoint's saved config): the split its pipeline flags describe. ValueError naming the flags
    for a split that does not work out or flags that cannot be combined (as in Megatron-LM)."""
    num_layers, pp = flags["num_layers"], flags.get("pipeline_model_parallel_size") or 1
    vpp, first, last = (flags.get(k) for k in ("num_layers_per_virtual_pipeline_stage",
                                              "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"))
    layout = flags.get("pipeline_model_parallel_layout")
    embedding, loss = (bool(flags.get(f"account_for_{k}_in_pipeline_split")) for k in ACCOUNT_FLAGS)
    uneven = [flag for flag, on in (("--decoder-first-pipeline-num-layers", first is not None),
                                    ("--decoder-last-pipeline-num-layers", last is not None),
                                    (ACCOUNT_FLAGS["embedding"], embedding), (ACCOUNT_FLAGS["loss"], loss)) if on]
    if layout is not None:
        others = uneven + (["--num-layers-per-virtual-pipeline-stage"] if vpp is not None else [])
        if others:
            raise ValueError(f"--pipeline-model-parallel-layout sets every stage's layers (and the virtual stages) "
                             f"itself; drop {', '.join(others)}")
        return layout_ranges(layout, num_layers, pp, flags.get("mtp_num_layers"))
    if embedding or loss:
        if first is not None or last is not None:
            raise ValueError(f"{' and '.join(uneven[-2:] if embedding and loss else uneven[-1:])} cannot be combined "
                             "with --decoder-first/last-pipeline-num-layers; use one or the other")
        return accounted_ranges(num_layers, pp, vpp, embedding, loss)
    return layer_ranges(num_layers, pp, vpp, first, last)


def interleaved(flags: Mapping) -> bool:
    """Whether a flat config's pipeline ranks hold several model chunks (virtual stages): the flag, or a layout's."""
    if flags.get("num_layers_per_virtual_pipeline_stage") is not None:
        return True
    return flags.get("pipeline_model_parallel_layout") is not None and len(pipeline_ranges(flags)[0]) > 1
