"""Time to a target on thin links for runs made elsewhere (``thinwire compare``'s, over
loopback): what the same methods take at 100 Mbit/s and 1 Gbit/s, measured on the thin-wire
testbed when it can be built, else modelled from the same runs.

1. the source (:func:`choose_source`): *measured* when asked for ``auto`` and the testbed can be
   built here (root, iproute2, ``ip netns add`` works: :func:`~thinwire.testbed.netns.unavailable_reason`),
   otherwise *modelled*, with the one-line reason;
2. measured (:func:`measured`): each method is rerun on the testbed, one link at a time, with the
   configuration of its loopback run but only for the steps that run needed to reach the target
   (:func:`testbed_steps`: its first evaluation at or past it; all its steps when it never got
   there), under one wall-clock limit for all of them, through the testbed's own loop
   (:func:`thinwire.testbed.bench.run_all`: fresh namespaces per run, always torn down). The run
   directories go under the loopback runs' own output folder (``OUT/thin_links/<link>/<method>``);
   if a run fails or the limit passes, the figures fall back to modelled and say why;
3. modelled (:func:`modelled`): each run's measured compute time plus its ledger's calls and
   bytes over the link's rate and latency (:func:`thinwire.testbed.modelled.model_run`);
4. per link, each method's seconds and steps to the target (the first evaluation at or past it);
   a method that never got there *does not reach* it and is never the fastest; every figure is
   labelled with its source;
5. the fastest method per link, and a plot of the metric against time on the link from the same
   source, one panel a link (:func:`thinwire.testbed.report.plot_bench`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from thinwire import config as config_mod
from thinwire.config import Config
from thinwire.report.tables import Run
from thinwire.testbed.measure import read_ledgers
from thinwire.testbed.modelled import model_run
from thinwire.testbed.rates import Link, parse_links
from thinwire.testbed.report import BenchResult, plot_bench

THIN_LINKS = "100mbit,1gbit"
SOURCES = ("auto", "modelled")
LIMIT_S = 600.0


def choose_source(requested: str, unavailable: str | None) -> tuple[str, str]:
    """Step 1: ``("measured", "")`` when ``requested`` is ``"auto"`` and the testbed is
    available (``unavailable`` is None), else ``("modelled", why)`` with the one-line reason."""
    if requested not in SOURCES:
        raise ValueError(f"thin-link source {requested!r}: one of {', '.join(SOURCES)}")
    if requested == "modelled":
        return "modelled", "modelled as asked (--thin-links modelled)"
    if unavailable is not None:
        return "modelled", f"no thin-wire testbed here ({unavailable})"
    return "measured", ""


def testbed_steps(run: Run, target: float) -> int:
    """Step 2's stopping rule: the step of ``run``'s first evaluation at or past ``target``
    (where it first reached it over loopback), or all of its steps if it never did."""
    for r in run.evals:
        if run.reached(float(r[run.metric]), target):
            return int(r["step"])
    return int(run.summary["steps"])


def testbed_configs(cfgs: Sequence[Config], runs: Sequence[Run], target: float,
                    links: Sequence[Link], out: Path) -> dict[str, list[Config]]:
    """Step 2's configs: per link label, each loopback config with its steps cut to
    :func:`testbed_steps` (rounded up to a whole number of the method's synchronisation periods,
    at most the loopback run's steps), the loopback run's threads per worker, and its run
    directory under ``out/<link>``."""
    groups: dict[str, list[Config]] = {}
    for link in links:
        groups[link.label] = [
            config_mod.build(config_mod.merge(config_mod.to_dict(cfg), {
                "train.steps": _whole_periods(testbed_steps(run, target), cfg),
                "run.out": str(out / link.label),
                "runtime.threads": _threads(cfg),
                "run.name": cfg.run_name, "run.resume": False, "run.overwrite": cfg.run.overwrite,
                "run.progress": False}))
            for cfg, run in zip(cfgs, runs)]
    return groups


def _threads(cfg: Config) -> int:
    """The loopback run's torch threads per worker (``0``: cores / workers), made explicit: in
    the testbed each worker is alone on its host, so ``0`` would give each one every core."""
    return cfg.runtime.threads or max(1, (os.cpu_count() or 1) // cfg.runtime.workers)


def _whole_periods(steps: int, cfg: Config) -> int:
    period = max(1, cfg.sync_every)
    return min(cfg.train.steps, -(-steps // period) * period)


def measured(cfgs: Sequence[Config], runs: Sequence[Run], target: float,
             links: Sequence[Link], out: Path, deadline: float) -> tuple[list[BenchResult], str]:
    """Step 2: every method on every link on the testbed, until the step its loopback run
    reached ``target`` at, by ``deadline`` (``time.monotonic()``). Returns the results (link-major)
    and why it stopped early ("" if it did not)."""
    from thinwire.testbed.bench import run_all
    from thinwire.testbed.netns import TestbedError

    groups = testbed_configs(cfgs, runs, target, links, out)
    try:
        return run_all(groups, list(links), deadline, modelled=False)
    except TestbedError as exc:
        return [], str(exc)


def modelled(runs: Sequence[Run], links: Sequence[Link]) -> list[BenchResult]:
    """Step 3: every run on every link, modelled (link-major order)."""
    out = []
    for link in links:
        for run in runs:
            ledgers = read_ledgers(run.path, int(run.summary["workers"]))
            m = model_run(run.summary, run.records, ledgers, link)
            out.append(BenchResult(link, run, "modelled", m.curve, m.wall_s))
    return out


def fastest(results: Sequence[BenchResult], target: float) -> str | None:
    """Step 5: the method of least time to ``target`` among ``results`` (None: none reaches)."""
    hits = [(h[1], r.method) for r in results if (h := r.to_target(target)) is not None]
    return min(hits)[1] if hits else None


def to_target_table(results: Sequence[BenchResult], target: float, why: str = "") -> str:
    """Step 4: one row per method, per link its seconds and steps to ``target``, labelled with
    the results' source; ``why`` is the reason modelled figures were used."""
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
    for lk in links:  # how far behind the fastest each other method is, said plainly
        on = [r for r in results if r.link == lk]
        best = min((h[1] for r in on if (h := r.to_target(target)) is not None), default=None)
        behind = [f"{r.method} {h[1] / best:.1f}x" for r in on
                  if best and (h := r.to_target(target)) is not None and h[1] > best]
        if behind:
            lines.append(f"at {lk.label}, time to the target over the fastest's: "
                         + ", ".join(behind))
    if kind == "modelled":
        lines.append(f"Modelled, not measured: {why}." if why else "Modelled, not measured.")
        lines.append("Modelled: each run's compute time over loopback + its ledger's calls x "
                     "latency + bytes / (rate x 1448/1538), thinwire.testbed.modelled.")
    else:
        lines.append("Measured on the thin-wire testbed (network namespaces, tc-shaped links, "
                     "thinwire.testbed): each method rerun until the step its loopback run "
                     "reached the target at; training wall time of rank 0, evaluation excluded.")
    return "\n".join(lines)


def report(results: Sequence[BenchResult], target: float, out_dir: Path, why: str = ""
           ) -> tuple[str, Path]:
    """Steps 4-5 for ``results`` (:func:`measured` or :func:`modelled`): the table's text and
    the plot's path (``out_dir/accuracy_vs_time_thin_links.png``)."""
    path = plot_bench(list(results), target, out_dir / "accuracy_vs_time_thin_links.png")
    return to_target_table(results, target, why), path


def modelled_report(runs: Sequence[Run], target: float, out_dir: Path, links: str = THIN_LINKS,
                    why: str = "") -> tuple[str, Path]:
    """Steps 3-5 for ``runs``: modelled on ``links``, the table's text and the plot's path."""
    return report(modelled(runs, parse_links(links)), target, out_dir, why)
