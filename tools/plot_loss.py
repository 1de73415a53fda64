"""Draw loss curves to a PNG from TensorBoard event files or console logs of training runs.

    python tools/plot_loss.py RUN [RUN ...] --output loss.png [--tag "lm loss"] [--labels a b] [--log-y]

Each RUN is a TensorBoard folder (``--tensorboard-dir``; searched recursively for
``events.out.tfevents.*``), a single event file, or a text file of console output holding Megatron's
training lines (``iteration N/ M | ... | lm loss: X |``) and validation lines
(``validation loss at iteration N | lm loss value: X |``; ``... N on validation set NAME | ...`` with
--multiple-validation-sets; ``... N on test set | ...``). Validation points are drawn as markers in the
run's colour, one marker shape per validation set (TensorBoard: ``lm loss validation`` and ``lm loss
validation NAME``), the test pass at the end of training (console logs only) as a star. Runs are labelled by their path unless ``--labels`` is given.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.errors import ConfigError, OneLineParser, run_tool  # noqa: E402
from megatron_lite.training.outputs import check_output_file, save_figure  # noqa: E402

_TRAIN = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|")
# " validation loss at iteration N |", "... N on validation set NAME |" (--multiple-validation-sets), "... N on test set |"
_VALID = re.compile(r"validation loss at iteration (\d+)(?: on (test) set| on validation set (.+?))?\s*\|")


class Curves(NamedTuple):
    """One run's points, each a sorted [(iteration, value)]: ``train``; ``valid``, one series per validation
    set (key None: the one validation split; NAME: a set of --multiple-validation-sets); ``test``, the
    test split's pass at the end (console logs only: it has no TensorBoard scalar)."""

    train: list
    valid: dict
    test: list


def _value(line: str, tag: str, suffix: str = "") -> float | None:
    m = re.search(rf"\|\s*{re.escape(tag)}{suffix}:\s*([-+0-9.eEinfaINFA]+)\s*\|", line)
    return float(m.group(1)) if m else None


def _curves(train: dict, valid: dict, test: dict) -> Curves:
    return Curves(sorted(train.items()), {name: sorted(points.items()) for name, points in valid.items()},
                  sorted(test.items()))


def read_log(path: str, tag: str = "lm loss") -> Curves:
    """The :class:`Curves` of a console log, by iteration; an iteration logged twice (a resumed run
    appending to the same log) takes its later value, as the TensorBoard reader takes a resumed run's
    later event file."""
    train, valid, test = {}, {}, {}
    with open(path, errors="replace") as f:
        for line in f:
            m = _TRAIN.search(line)
            if m:
                value = _value(line, tag)
                if value is not None:
                    train[int(m.group(1))] = value
                continue
            m = _VALID.search(line)
            value = _value(line, tag, " value") if m else None
            if value is not None:
                points = test if m.group(2) else valid.setdefault(m.group(3), {})
                points[int(m.group(1))] = value
    return _curves(train, valid, test)


def _event_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True))


def _validation_tags(tag: str, scalars: set) -> dict:
    """{scalar name: set name} of the validation scalars: ``<tag> validation`` (None) and
    ``<tag> validation NAME``, without the ``... ppl`` ones (--log-validation-ppl-to-tensorboard); a set
    named ``ppl`` is one where no plain validation scalar has that ppl name."""
    plain = f"{tag} validation"
    names = {s[len(plain) + 1:] for s in scalars if s.startswith(plain + " ")}
    ppl = {n for n in names if n.endswith(" ppl") and n[:-4] in names}
    if plain in scalars:
        ppl.add("ppl")
    return {**({plain: None} if plain in scalars else {}), **{f"{plain} {n}": n for n in names - ppl}}


def read_tensorboard(path: str, tag: str = "lm loss") -> Curves:
    """The :class:`Curves` of event files: ``tag``, ``<tag> validation`` and ``<tag> validation NAME``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, valid = {}, {}
    for file in _event_files(path):
        acc = EventAccumulator(file, size_guidance={"scalars": 0})
        acc.Reload()
        scalars = set(acc.Tags().get("scalars", []))
        series = {name: valid.setdefault(set_name, {}) for name, set_name in _validation_tags(tag, scalars).items()}
        if tag in scalars:
            series[tag] = train
        for name, points in series.items():
            for event in acc.Scalars(name):
                points[event.step] = event.value  # a resumed run's later file wins
    return _curves(train, valid, {})


def read_run(path: str, tag: str = "lm loss") -> Curves:
    if os.path.isdir(path) or os.path.basename(path).startswith("events.out.tfevents."):
        return read_tensorboard(path, tag)
    return read_log(path, tag)


_MARKERS = "osD^vP<>"


def plot(runs: list[tuple[str, list, list]], output: str, tag: str = "lm loss", log_y: bool = False,
         flag: str | None = None) -> None:
    """Draw the runs' curves into ``output``; ``flag``: see :func:`save_figure` (a failed write)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, curves in runs:
        train = curves.train
        (line,) = ax.plot([s for s, _ in train], [v for _, v in train], label=label, linewidth=1.2)
        for i, (name, valid) in enumerate(sorted(curves.valid.items(), key=lambda kv: kv[0] or "")):
            ax.plot([s for s, _ in valid], [v for _, v in valid], _MARKERS[i % len(_MARKERS)],
                    color=line.get_color(), label=f"{label} (validation{'' if name is None else ' ' + name})")
        if curves.test:
            ax.plot([s for s, _ in curves.test], [v for _, v in curves.test], "*", markersize=12,
                    color=line.get_color(), label=f"{label} (test)")
    ax.set_xlabel("iteration")
    ax.set_ylabel(tag)
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        save_figure(fig, output, flag=flag)
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="TensorBoard folders, event files or console log files")
    p.add_argument("--output", "-o", default="loss.png", help="PNG file to write")
    p.add_argument("--tag", default="lm loss", help="loss name (TensorBoard scalar / log field)")
    p.add_argument("--labels", nargs="+", help="one legend label per run")
    p.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        p.error(f"--labels has {len(args.labels)} names for {len(args.runs)} runs")
    try:
        check_output_file("--output", args.output)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    runs = []
    for i, path in enumerate(args.runs):
        if not os.path.exists(path):
            print(f"error: {path} does not exist", file=sys.stderr)
            return 2
        curves = read_run(path, args.tag)
        if not curves.train and not any(curves.valid.values()) and not curves.test:
            print(f"error: no {args.tag!r} values found in {path} (a TensorBoard folder or a console log?)",
                  file=sys.stderr)
            return 2
        runs.append((args.labels[i] if args.labels else path, curves))
    try:
        plot(runs, args.output, args.tag, args.log_y, flag="--output")
    except ConfigError as err:  # the write failed after the check (a full disk): nothing left behind
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({'; '.join(summary(label, c, args.tag) for label, c in runs)})")
    return 0


def summary(label: str, curves: Curves, tag: str) -> str:
    """One run in a line: its points, the loss from the first to the last one (did it go down?), each
    validation set's last value and the test value."""
    train = curves.train
    text = f"{label}: {len(train)} points"
    if train:
        text += f", {tag} {train[0][1]:.3f} at {train[0][0]} -> {train[-1][1]:.3f} at {train[-1][0]}"
    for name, valid in sorted(curves.valid.items(), key=lambda kv: kv[0] or ""):
        if valid:
            text += f", validation{'' if name is None else ' ' + name} {valid[-1][1]:.3f} at {valid[-1][0]}"
    for step, value in curves.test:
        text += f", test {value:.3f} at {step}"
    return text


if __name__ == "__main__":
    sys.exit(run_tool(main))
