"""Draw loss curves to a PNG from TensorBoard event files or console logs of training runs.

    python tools/plot_loss.py RUN [RUN ...] --output loss.png [--tag "lm loss"] [--labels a b] [--log-y]

Each RUN is a TensorBoard folder (``--tensorboard-dir``; searched recursively for
``events.out.tfevents.*``), a single event file, or a text file of console output holding Megatron's
training lines (``iteration N/ M | ... | lm loss: X |``) and validation lines
(``validation loss at iteration N | lm loss value: X |``). Validation points are drawn as markers
in the same colour when present. Runs are labelled by their path unless ``--labels`` is given.
"""

from __future__ import annotations

import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.errors import ConfigError, OneLineParser  # noqa: E402
from megatron_lite.training.outputs import check_output_file, save_figure  # noqa: E402

_TRAIN = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|")
_VALID = re.compile(r"validation loss at iteration (\d+)\s*\|")


def _value(line: str, tag: str, suffix: str = "") -> float | None:
    m = re.search(rf"\|\s*{re.escape(tag)}{suffix}:\s*([-+0-9.eEinfaINFA]+)\s*\|", line)
    return float(m.group(1)) if m else None


def read_log(path: str, tag: str = "lm loss") -> tuple[list, list]:
    """([(iteration, train loss)], [(iteration, validation loss)]) from a console log, by iteration; an
    iteration logged twice (a resumed run appending to the same log) takes its later value, as the
    TensorBoard reader takes a resumed run's later event file."""
    train, valid = {}, {}
    with open(path, errors="replace") as f:
        for line in f:
            m = _TRAIN.search(line)
            if m:
                value = _value(line, tag)
                if value is not None:
                    train[int(m.group(1))] = value
                continue
            m = _VALID.search(line)
            if m:
                value = _value(line, tag, " value")
                if value is not None:
                    valid[int(m.group(1))] = value
    return sorted(train.items()), sorted(valid.items())


def _event_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True))


def read_tensorboard(path: str, tag: str = "lm loss") -> tuple[list, list]:
    """([(step, value)] of ``tag``, [(step, value)] of ``"<tag> validation"``) from event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series = {tag: {}, f"{tag} validation": {}}
    for file in _event_files(path):
        acc = EventAccumulator(file, size_guidance={"scalars": 0})
        acc.Reload()
        scalars = set(acc.Tags().get("scalars", []))
        for name, points in series.items():
            if name in scalars:
                for event in acc.Scalars(name):
                    points[event.step] = event.value  # a resumed run's later file wins
    return sorted(series[tag].items()), sorted(series[f"{tag} validation"].items())


def read_run(path: str, tag: str = "lm loss") -> tuple[list, list]:
    if os.path.isdir(path) or os.path.basename(path).startswith("events.out.tfevents."):
        return read_tensorboard(path, tag)
    return read_log(path, tag)


def plot(runs: list[tuple[str, list, list]], output: str, tag: str = "lm loss", log_y: bool = False,
         flag: str | None = None) -> None:
    """Draw the runs' curves into ``output``; ``flag``: see :func:`save_figure` (a failed write)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, train, valid in runs:
        (line,) = ax.plot([s for s, _ in train], [v for _, v in train], label=label, linewidth=1.2)
        if valid:
            ax.plot([s for s, _ in valid], [v for _, v in valid], "o", color=line.get_color(),
                    label=f"{label} (validation)")
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
        train, valid = read_run(path, args.tag)
        if not train and not valid:
            print(f"error: no {args.tag!r} values found in {path} (a TensorBoard folder or a console log?)",
                  file=sys.stderr)
            return 2
        runs.append((args.labels[i] if args.labels else path, train, valid))
    try:
        plot(runs, args.output, args.tag, args.log_y, flag="--output")
    except ConfigError as err:  # the write failed after the check (a full disk): nothing left behind
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({'; '.join(summary(label, t, v, args.tag) for label, t, v in runs)})")
    return 0


def summary(label: str, train: list, valid: list, tag: str) -> str:
    """One run in a line: its points, the loss from the first to the last one (did it go down?), the last
    validation value."""
    text = f"{label}: {len(train)} points"
    if train:
        text += f", {tag} {train[0][1]:.3f} at {train[0][0]} -> {train[-1][1]:.3f} at {train[-1][0]}"
    if valid:
        text += f", validation {valid[-1][1]:.3f} at {valid[-1][0]}"
    return text


if __name__ == "__main__":
    sys.exit(main())
