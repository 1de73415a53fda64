"""Which global transformer layers each pipeline rank (and each of its model chunks) holds."""

from __future__ import annotations


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
