"""``--pipeline-model-parallel-layout``: Megatron-LM's string naming what each (virtual) pipeline stage holds.

Grammar (Megatron-LM's): ``|`` separates the stages, listed in virtual-stage order (virtual stage
``s`` is chunk ``s // pp`` of pipeline rank ``s % pp``; ``pp x vp`` stages, so the number of stages
gives the virtual size); inside a stage ``E`` is the embedding, ``t`` a transformer layer, ``m`` a
multi-token prediction layer, ``L`` the loss (the final norm and output layer); ``X*N`` repeats one
character (``|`` too), ``(...)*N`` a group (no nesting); commas are cosmetic. ``"E|(tt|)*2,tL"`` is
``E|tt|tt|tL``.

What runs here: ``E`` first in the first stage, ``L`` last in the last stage, the ``m`` layers (as
many as --mtp-num-layers) in the last stage just before ``L`` (they run with the output layer), and
every other stage holding at least one ``t`` (a stage with no layer would hold no parameter). The
first and the last stage may hold no transformer layer (``E|tttt|L``).
"""

from __future__ import annotations

FLAG = "--pipeline-model-parallel-layout"
SYMBOLS = "EtmL"
MAX_SYMBOLS = 1_000_000  # far beyond any model; a typo's huge count is refused before it is written out


def _expand(text: str, whole: str | None = None) -> str:
    """``text`` with its ``X*N`` and ``(...)*N`` repetitions written out and its commas dropped
    (``whole``: the layout ``text`` is part of, for the messages)."""
    out, i, whole = [], 0, whole or text
    text = text.replace(",", "")
    while i < len(text):
        ch = text[i]
        if ch == "(":
            close = text.find(")", i)
            if close < 0 or "(" in text[i + 1:close]:
                raise ValueError(f"{FLAG} {whole!r}: a '(' without its ')' (groups cannot nest); write e.g. (tt|)*2")
            if close == i + 1:
                raise ValueError(f"{FLAG} {whole!r}: an empty group '()'")
            unit, i = _expand(text[i + 1:close], whole), close + 1  # its own X*N first, as in Megatron-LM
        elif ch == ")":
            raise ValueError(f"{FLAG} {whole!r}: a ')' without its '('")
        elif ch in SYMBOLS or ch == "|":
            unit, i = ch, i + 1
        elif ch == "*":
            raise ValueError(f"{FLAG} {whole!r}: '*' must follow a layer symbol, '|' or a ')' group")
        else:
            raise ValueError(f"{FLAG} {whole!r}: unknown character {ch!r}; use E (embedding), t (transformer layer), "
                             "m (multi-token prediction layer), L (loss), '|' between stages, X*N and (...)*N")
        if i < len(text) and text[i] == "*":
            digits = len(text) - i - 1 - len(text[i + 1:].lstrip("0123456789"))
            if digits == 0:
                raise ValueError(f"{FLAG} {whole!r}: '*' needs a repeat count after it, e.g. t*3")
            count = int(text[i + 1:i + 1 + digits])
            if len(unit) * count > MAX_SYMBOLS:
                raise ValueError(f"{FLAG} {whole!r}: a repetition gives more than {MAX_SYMBOLS} symbols")
            unit, i = unit * count, i + 1 + digits
        elif ch == "(":
            raise ValueError(f"{FLAG} {whole!r}: a group must be repeated, e.g. (tt|)*2")
        out.append(unit)
    return "".join(out)


def parse_layout(text: str) -> list[str]:
    """The stages of a layout string, in virtual-stage order, each as its symbols (``"Ett"``)."""
    if not text or not text.strip():
        raise ValueError(f"{FLAG} is empty; give the stages, e.g. 'Et|tt|tL'")
    return _expand(text).split("|")


def _where(s: int, pp: int) -> str:
    return f"stage {s} (pipeline rank {s % pp}" + (f", virtual stage {s // pp})" if s >= pp else ")")


def layout_ranges(text: str, num_layers: int, pp: int, mtp_layers: int | None = 0) -> list[list[tuple[int, int]]]:
    """``[pp_rank][chunk] -> (layer_start, layer_end)`` of a layout string; ValueError naming the flags."""
    stages = parse_layout(text)
    mtp_layers = mtp_layers or 0
    n = len(stages)
    if n % pp:
        raise ValueError(f"{FLAG} {text!r} has {n} stages, not a multiple of --pipeline-model-parallel-size {pp}; "
                         "give pp x virtual-stages stages")
    vp = n // pp
    if vp > 1 and pp < 2:
        raise ValueError(f"{FLAG} {text!r}: {n} virtual stages need --pipeline-model-parallel-size >= 2 "
                         "(interleaving runs over pipeline ranks); give one stage per rank")
    flat = "".join(stages)
    if flat.count("t") != num_layers:
        raise ValueError(f"{FLAG} {text!r} places {flat.count('t')} transformer layers (t), --num-layers is "
                         f"{num_layers}; make them agree")
    if flat.count("m") != mtp_layers:
        raise ValueError(f"{FLAG} {text!r} places {flat.count('m')} multi-token prediction layers (m), "
                         f"--mtp-num-layers is {mtp_layers}; make them agree")
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise ValueError(f"{FLAG} {text!r}: the embedding E must appear once, first in the first stage")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise ValueError(f"{FLAG} {text!r}: the loss L must appear once, last in the last stage")
    last = stages[-1]
    if "m" in flat and (last.count("m") != mtp_layers or not last.endswith("m" * mtp_layers + "L")):
        raise ValueError(f"{FLAG} {text!r}: the multi-token prediction layers m run with the output layer here; "
                         "put all of them in the last stage, just before L (e.g. 'Et|tmL')")
    for s, stage in enumerate(stages[1:-1], start=1):
        if "t" not in stage:
            raise ValueError(f"{FLAG} {text!r}: {_where(s, pp)} would hold no layers and no parameters; "
                             "give every stage but the first and the last at least one t")
    out: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    start = 0
    for s, stage in enumerate(stages):
        count = stage.count("t")
        out[s % pp].append((start, start + count))
        start += count
    return out
