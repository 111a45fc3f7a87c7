"""Time to a target on thin links for runs made elsewhere (``thinwire compare``'s, over
loopback): what the same runs would take at 100 Mbit/s and 1 Gbit/s.

1. each run is modelled on each link (:func:`thinwire.testbed.modelled.model_run`: its measured
   compute time plus its ledger's calls and bytes over the link's rate and latency), so every
   figure here is *modelled* and says so; measured thin-link times come from ``thinwire bench``
   on the testbed;
2. per link, each method's modelled seconds and steps to the target (the first evaluation at or
   past it); a method that never got there *does not reach* it and is never the fastest;
3. the fastest method per link, and a plot of the metric against modelled time, one panel a
   link (:func:`thinwire.testbed.report.plot_bench`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from thinwire.report.tables import Run
from thinwire.testbed.measure import read_ledgers
from thinwire.testbed.modelled import model_run
from thinwire.testbed.rates import Link, parse_links
from thinwire.testbed.report import BenchResult, plot_bench

THIN_LINKS = "100mbit,1gbit"


def modelled(runs: Sequence[Run], links: Sequence[Link]) -> list[BenchResult]:
    """Step 1: every run on every link, modelled (link-major order)."""
    out = []
    for link in links:
        for run in runs:
            ledgers = read_ledgers(run.path, int(run.summary["workers"]))
            m = model_run(run.summary, run.records, ledgers, link)
            out.append(BenchResult(link, run, "modelled", m.curve, m.wall_s))
    return out


def fastest(results: Sequence[BenchResult], target: float) -> str | None:
    """Step 3: the method of least time to ``target`` among ``results`` (None: none reaches)."""
    hits = [(h[1], r.method) for r in results if (h := r.to_target(target)) is not None]
    return min(hits)[1] if hits else None


def to_target_table(results: Sequence[BenchResult], target: float) -> str:
    """Step 2: one row per method, per link its seconds and steps to ``target``."""
    links = list(dict.fromkeys(r.link for r in results))
    methods = list(dict.fromkeys(r.method for r in results))
    kind = results[0].kind if results else "modelled"
    metric = results[0].run.metric if results else "accuracy"
    head = "| method | " + " | ".join(f"s to {target:.3f} at {lk.label} ({kind}) | steps"
                                      for lk in links) + " |"
    lines = [f"Time to {metric} {target:.3f} on thin links ({kind}):", "", head,
             "|---|" + "---:|---:|" * len(links)]
    for m in methods:
        cells = []
        for lk in links:
            r = next(r for r in results if r.link == lk and r.method == m)
            hit = r.to_target(target)
            cells.append(f"{hit[1]:.1f} | {hit[0]}" if hit else "does not reach | -")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("fastest to the target: " + "; ".join(
        f"{lk.label} {fastest([r for r in results if r.link == lk], target) or 'none reaches it'}"
        for lk in links))
    if kind == "modelled":
        lines.append("Modelled (no thin wire was used): each run's compute time over loopback + "
                     "its ledger's calls x latency + bytes / (rate x 1448/1538), "
                     "thinwire.testbed.modelled; measured times: thinwire bench on the testbed "
                     "(as root).")
    return "\n".join(lines)


def report(runs: Sequence[Run], target: float, out_dir: Path, links: str = THIN_LINKS
           ) -> tuple[str, Path]:
    """Steps 1-3 for ``runs``: the table's text and the plot's path
    (``out_dir/accuracy_vs_time_thin_links.png``)."""
    results = modelled(runs, parse_links(links))
    path = plot_bench(results, target, out_dir / "accuracy_vs_time_thin_links.png")
    return to_target_table(results, target), path
