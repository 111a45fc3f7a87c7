"""Figures and tables of the theory lab (Shulgin & Richtarik, ICML 2024, on quadratics).

Steps of every error figure (``error_figure``):
  1. one panel per ``Panel``; each curve is an error sequence drawn against its iteration;
  2. predictions (limit floors, predicted plateaus) are dashed horizontal lines, predicted
     rates dotted curves, in the colour of the curve they predict when one is given;
  3. log-scale y axis, legend, fixed margins (no layout pass: one draw per figure), saved once as
     PNG with the Agg canvas (no display, no pyplot; matplotlib is imported on first use).
Tables are GitHub markdown with numbers printed by ``fmt``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True, eq=False)
class Curve:
    """One error sequence; ``x`` defaults to 0..len(y)-1; ``style`` is a matplotlib format."""

    label: str
    y: np.ndarray
    x: np.ndarray | None = None
    style: str = "-"
    color: str | None = None


@dataclass(frozen=True)
class HLine:
    """A predicted constant (a floor or a plateau)."""

    label: str
    y: float
    color: str | None = None
    style: str = "--"


@dataclass(frozen=True)
class Panel:
    title: str
    curves: Sequence[Curve]
    hlines: Sequence[HLine] = field(default_factory=tuple)
    xlabel: str = "iteration k"
    ylabel: str = r"$\|x_k - x^*\|^2_{\bar L}$"
    logx: bool = False
    vlines: Sequence[HLine] = field(default_factory=tuple)
    ymin: float | None = None  # clip the view (values keep their meaning; the table has them)


# margins of every figure, in inches: room for the y label, the x label, the titles
LEFT, RIGHT, BOTTOM, TOP, GAP = 0.85, 0.2, 0.6, 0.75, 0.95
PANEL_W, HEIGHT = 6.2, 4.4


def _figure(panels: int):  # type: ignore[no-untyped-def]
    """A figure of ``panels`` axes side by side with fixed margins (steps 1 and 3)."""
    from matplotlib.figure import Figure

    width = PANEL_W * panels
    fig = Figure(figsize=(width, HEIGHT))
    axes = fig.subplots(1, panels, squeeze=False)[0]
    inner = (width - LEFT - RIGHT - GAP * (panels - 1)) / panels
    fig.subplots_adjust(
        left=LEFT / width,
        right=1 - RIGHT / width,
        bottom=BOTTOM / HEIGHT,
        top=1 - TOP / HEIGHT,
        wspace=GAP / inner,
    )
    return fig, axes


def _positive(y: np.ndarray) -> np.ndarray:
    """Zeros cannot sit on a log axis; show them at the smallest positive double."""
    return np.maximum(np.asarray(y, dtype=np.float64), np.finfo(np.float64).tiny)


def error_figure(path: Path, panels: Sequence[Panel], suptitle: str = "") -> Path:
    """Draw ``panels`` side by side into ``path`` (steps 1-3)."""
    fig, axes = _figure(len(panels))
    for ax, panel in zip(axes, panels):
        for curve in panel.curves:  # step 1
            x = np.arange(len(curve.y)) if curve.x is None else curve.x
            ax.plot(
                x, _positive(curve.y), curve.style, color=curve.color, label=curve.label, lw=1.3
            )
        for line in panel.hlines:  # step 2
            ax.axhline(line.y, ls=line.style, color=line.color or "k", lw=1.1, label=line.label)
        for line in panel.vlines:
            ax.axvline(line.y, ls=line.style, color=line.color or "k", lw=1.1, label=line.label)
        ax.set_yscale("log")  # step 3
        if panel.logx:
            ax.set_xscale("log")
        if panel.ymin is not None:
            ax.set_ylim(bottom=panel.ymin)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11, y=1 - 0.12 / HEIGHT, va="top")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return path


def fmt(value: object) -> str:
    """Numbers for tables: 3 significant digits, scientific when tiny or huge, 'inf' spelled out."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        return str(value)
    v = float(value)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if math.isnan(v):
        return "nan"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.2e}"
    return f"{v:.3g}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; every cell goes through ``fmt``, and a '|' in text is escaped."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "| " + " | ".join(cell(h) for h in headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(cell(fmt(c)) for c in row) + " |" for row in rows]
    return "\n".join(lines)
