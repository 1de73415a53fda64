"""Which layers each pipeline rank of a planned layout holds, and how much work that gives each rank.

The split is training's: :func:`~megatron_lite.parallel.pipeline.partition.pipeline_ranges` reads
the layout's pipeline flags (``--pipeline-model-parallel-layout``,
``--account-for-embedding/loss-in-pipeline-split``, ``--decoder-first/last-pipeline-num-layers``,
the virtual stages) and gives every rank's chunks; the planner keeps no rule of its own. Its one
choice: a layout that names no split, whose layer count PP does not divide (and without virtual
stages), gets the first and last stage sizes of :func:`default_first_last` (the middle stages
``ceil(L / PP)`` layers each, the rest shared by the first, the larger half, and the last stage).
The embedding is on rank 0's first chunk, the output layer, the loss and the multi-token
prediction layers on the last rank's last chunk, wherever the split puts the layers (training's
rule; a layout string that puts them elsewhere is refused).
"""

from __future__ import annotations

from functools import lru_cache

from ...errors import ConfigError
from ...moe.layer_pattern import parse_moe_layer_freq
from ...parallel.pipeline.layout import parse_layout
from ...parallel.pipeline.partition import pipeline_ranges
from ..flops import forward_flops_per_layer, layer_windows, logits_flops

SPLIT_DEFAULTS = {"pipeline_layout": None, "first": None, "last": None, "account_embedding": False,
                  "account_loss": False}
"""The :class:`~.estimate.Layout` fields that choose the split (training's flags below), unset."""
SPLIT_FIELDS = tuple(SPLIT_DEFAULTS)
SPLIT_FLAGS = {"pipeline_layout": "--pipeline-model-parallel-layout",
               "first": "--decoder-first-pipeline-num-layers", "last": "--decoder-last-pipeline-num-layers",
               "account_embedding": "--account-for-embedding-in-pipeline-split",
               "account_loss": "--account-for-loss-in-pipeline-split"}


def default_first_last(num_layers: int, pp: int) -> tuple[int | None, int | None]:
    """The planner's first and last stage sizes where PP does not divide the layers (else None, None)."""
    if pp < 2 or num_layers % pp == 0:
        return None, None
    per = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * per
    return -(-rest // 2), rest // 2


def layout_stages(text: str) -> int:
    """Stages (pp x virtual stages) a layout string names; ConfigError for a malformed string."""
    try:
        return len(parse_layout(text))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _names_split(split: dict) -> bool:
    return any(value not in (None, False) for value in split.values())


def split_fields(lay) -> dict:
    """``lay``'s split fields (:data:`SPLIT_FIELDS`) as a dict."""
    return {f: getattr(lay, f) for f in SPLIT_FIELDS}


def split_config(num_layers: int, mtp_layers: int, pp: int, vpp: int, split: dict) -> dict:
    """The flat flags :func:`pipeline_ranges` reads, for a layout's PP, VPP and split fields."""
    first, last = split["first"], split["last"]
    accounted = num_layers + split["account_embedding"] + split["account_loss"]
    per_virtual = None
    if split["pipeline_layout"] is None and vpp > 1:
        if accounted % (pp * vpp):
            extra = f" + {accounted - num_layers} accounted" * (accounted > num_layers)
            raise ConfigError(f"PP {pp} x VPP {vpp} must divide --num-layers {num_layers}{extra}")
        per_virtual = accounted // (pp * vpp)
    elif not _names_split(split):
        first, last = default_first_last(num_layers, pp)
    return {"num_layers": num_layers, "pipeline_model_parallel_size": pp, "mtp_num_layers": mtp_layers,
            "num_layers_per_virtual_pipeline_stage": per_virtual, "decoder_first_pipeline_num_layers": first,
            "decoder_last_pipeline_num_layers": last, "pipeline_model_parallel_layout": split["pipeline_layout"],
            "account_for_embedding_in_pipeline_split": split["account_embedding"],
            "account_for_loss_in_pipeline_split": split["account_loss"]}


def rank_ranges(spec, lay) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``[pp_rank][chunk] -> (layer_start, layer_end)`` of ``lay`` (training's :func:`pipeline_ranges`);
    one ConfigError, training's words, for a split that does not work out."""
    return split_ranges(spec.num_layers, spec.mtp_num_layers, lay.pp, lay.vpp, tuple(split_fields(lay).values()))


@lru_cache(maxsize=4096)
def split_ranges(num_layers: int, mtp: int, pp: int, vpp: int, values: tuple) -> tuple:
    """:func:`rank_ranges` from plain values (``values``: the :data:`SPLIT_FIELDS`, in order)."""
    split = dict(zip(SPLIT_FIELDS, values))
    text = split["pipeline_layout"]
    if text is not None:
        stages = layout_stages(text)
        if stages % pp == 0 and stages // pp != vpp:
            raise ConfigError(f"--pipeline-model-parallel-layout {text!r} gives PP {pp} {stages // pp} virtual "
                              f"stages, not VPP {vpp}; drop --virtual-pipeline-model-parallel-size")
    try:
        ranges = pipeline_ranges(split_config(num_layers, mtp, pp, vpp, split))
    except ValueError as err:
        if vpp == 1 and not _names_split(split):  # the planner's own default split
            raise ConfigError(f"PP {pp} cannot split --num-layers {num_layers} (evenly, or with smaller first and "
                              "last stages)") from None
        raise ConfigError(str(err)) from None
    return tuple(tuple(chunks) for chunks in ranges)


def check_split(spec, fixed: dict) -> None:
    """One ConfigError, training's words, for split flags no layout can take: a malformed
    ``pipeline_layout`` or one that does not fit the model (checked at the fixed PP, else at one stage
    per rank), or flags training refuses together. Other splits are checked per layout."""
    split = {f: default if fixed.get(f) is None else fixed[f] for f, default in SPLIT_DEFAULTS.items()}
    text = split["pipeline_layout"]
    together = (split["account_embedding"] or split["account_loss"]) and (split["first"], split["last"]) != (None, None)
    if text is None and not together:
        return
    pp = fixed.get("pp") or (layout_stages(text) if text is not None else 2)
    stages = layout_stages(text) if text is not None else pp
    vpp = fixed.get("vpp") or max(1, stages // pp)
    split_ranges(spec.num_layers, spec.mtp_num_layers, pp, vpp, tuple(split.values()))


def rank_layers(spec, lay) -> list[int]:
    """Transformer layers each pipeline rank holds (over its chunks)."""
    return [sum(hi - lo for lo, hi in chunks) for chunks in rank_ranges(spec, lay)]


def split_label(spec, lay) -> str:
    """How ``lay`` splits the layers, for the table: '' (even), 'first F last L', 'acct E+L', or the layout."""
    if lay.pipeline_layout is not None:
        return lay.pipeline_layout
    if lay.account_embedding or lay.account_loss:
        return "acct " + "+".join(k for k, on in (("E", lay.account_embedding), ("L", lay.account_loss)) if on)
    named = _names_split(split_fields(lay))
    if lay.vpp > 1 and not named:
        return ""
    first, last = (lay.first, lay.last) if named else default_first_last(spec.num_layers, lay.pp)
    return " ".join(f"{k} {v}" for k, v in (("first", first), ("last", last)) if v is not None)


@lru_cache(maxsize=4096)
def rank_work(spec, tp: int, ranges: tuple, recompute_full: bool) -> tuple[float, ...]:
    """Training FLOPs of one micro-batch on each pipeline rank: its layers (forward, backward and,
    under full recomputation, the repeated forward), the last rank's multi-token prediction layers,
    their projections and every depth's output layer (the embedding's lookup is no matmul)."""
    padded = spec.with_vocab(tp)
    moe = parse_moe_layer_freq(spec.moe_layer_freq, spec.num_layers) if spec.is_moe else [False] * spec.num_layers
    kinds = list(zip(moe + moe[-1:] * spec.mtp_num_layers, layer_windows(padded)))
    cost = {kind: forward_flops_per_layer(padded, 1, padded if kind[0] else None, kind[1]) for kind in set(kinds)}
    passes = 4 if recompute_full else 3
    work = [passes * sum(cost[kinds[i]] for lo, hi in chunks for i in range(lo, hi)) for chunks in ranges]
    mtp = spec.mtp_num_layers
    h = spec.hidden_size
    work[-1] += passes * sum(cost[k] for k in kinds[spec.num_layers:])
    work[-1] += 3 * (mtp * 2 * spec.seq_length * 2 * h * h + (1 + mtp) * logits_flops(padded, 1))
    return tuple(work)


def busiest_share(spec, lay) -> float:
    """The busiest rank's work over the mean rank's (1 when every rank does the same work)."""
    work = rank_work(spec, lay.tp, rank_ranges(spec, lay), lay.recompute == "full")
    return max(work) * len(work) / sum(work)
