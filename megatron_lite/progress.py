"""Progress of the long-running tools: a tqdm bar on a terminal, plain lines in a log file.

tqdm redraws its bar with carriage returns; written to a file (``tool ... 2> log``, a scheduler's
output file, a pipe) every redraw stays, and the log fills with ``\\r`` lines. :func:`progress` gives
the bar only when the stream is a terminal; otherwise a plain line (``windows: 40/120 batch (33%),
12.5 batch/s``) at most every ``interval`` seconds, nothing in between. Every tool uses this one
helper (tools/evaluate.py, tools/checkpoint/convert.py, tools/preprocess_sft.py, tools/run_lm_eval.py).
"""

from __future__ import annotations

import sys
import time

LOG_SECONDS = 30.0  # a plain line at most this often (a log file)


def progress(iterable=None, *, total=None, desc: str = "", unit: str = "it", enabled: bool = True,
             stream=None, interval: float = LOG_SECONDS, **tqdm_kw):
    """A progress reporter over ``iterable`` (or ``total`` steps counted with ``update(n)``): a tqdm bar
    when ``stream`` (default stderr) is a terminal, :class:`LogLines` otherwise, silent when not
    ``enabled``. Supports iteration, ``update``, ``set_postfix_str``, ``close`` and ``with``."""
    stream = sys.stderr if stream is None else stream
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if enabled and _is_terminal(stream):
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream, **tqdm_kw)
    return LogLines(iterable, total, desc, unit, stream, interval if enabled else None,
                    tqdm_kw.get("unit_scale", False), tqdm_kw.get("unit_divisor", 1000))


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LogLines:
    """tqdm's interface, reporting with a plain line at most every ``interval`` seconds (None: never)."""

    def __init__(self, iterable, total, desc, unit, stream, interval, unit_scale=False, divisor=1000):
        self.iterable, self.total, self.desc, self.unit, self.stream = iterable, total, desc, unit, stream
        self.interval, self.unit_scale, self.divisor = interval, unit_scale, divisor
        self.n, self.postfix = 0, ""
        self.start = self.last = time.monotonic()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)

    def __len__(self):
        return self.total or 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _amount(self, n) -> str:
        if not self.unit_scale:
            return f"{n:g}" if isinstance(n, float) else str(n)
        for prefix in ("", "k", "M", "G", "T"):
            if abs(n) < 999.5 or prefix == "T":
                return f"{n:.3g}{prefix}"
            n /= self.divisor
        return str(n)

    def line(self) -> str:
        """The progress line: done (of total, percent), rate, postfix."""
        done = self._amount(self.n)
        of = f"/{self._amount(self.total)}" if self.total else ""
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        rate = self.n / max(time.monotonic() - self.start, 1e-9)
        postfix = f", {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {done}{of} {self.unit}{percent}, {self._amount(rate)} {self.unit}/s{postfix}"

    def update(self, n=1) -> None:
        self.n += n
        now = time.monotonic()
        if self.interval is not None and now - self.last >= self.interval:
            self.last = now
            print(self.line(), file=self.stream, flush=True)

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        del refresh
        self.postfix = text

    def close(self) -> None:
        pass
