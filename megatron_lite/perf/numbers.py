"""Numbers as the logs and tools print them: readable at any size, never a misleading 0.0 for the
tiny models of a CPU run."""

from __future__ import annotations


def figure(x: float) -> str:
    """One decimal from 1 up (``812.3``), two significant digits below (``0.0042``), ``0.0`` for zero."""
    x = float(x)
    short = f"{x:.2g}"
    return f"{x:.1f}" if x == 0 or abs(x) >= 1 or abs(float(short)) >= 1 else short  # 0.996: "1.0", not "1"


def count(n: float) -> str:
    """A parameter count: ``6.74 B``, ``124.4 M``, ``33.9 K`` or ``512``."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale or (scale > 1e3 and abs(round(n / scale * 1e3, 1)) >= 1e3):  # 999,999: 1.0 M, not 1000.0 K
            return f"{n / scale:.{2 if unit == 'B' else 1}f} {unit}"
    return f"{int(n)}"
