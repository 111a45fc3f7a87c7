"""Plain-text tables and number formats for the planner's command line (no dependencies)."""

from __future__ import annotations

from collections.abc import Sequence

GIB = 1024.0**3


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    """A fixed-width table; the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        )

    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def seconds(x: float) -> str:
    """Seconds with a unit that keeps three significant digits."""
    if x == 0:
        return "0"
    if x >= 1:
        return f"{x:.3g} s" if x < 1000 else f"{x:,.0f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} us"


def nbytes(x: float) -> str:
    """Bytes in B, KB, MB, GB, TB (decimal)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def rate(x: float) -> str:
    """Bytes/s as bit/s, the way links are sold."""
    bits = 8 * x
    for unit, scale in (("Tb/s", 1e12), ("Gb/s", 1e9), ("Mb/s", 1e6), ("kb/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} b/s"


def pct(x: float, digits: int = 1) -> str:
    """A signed percentage of a fraction."""
    return f"{100 * x:+.{digits}f}%"
