"""``thinwire compare``: several methods on the same data, model and workers, one table.

``--methods dp,localsgd,ist`` (default) runs each method in turn with the same config and
prints: the task's metric (accuracy, or perplexity) and NLL, bytes sent per worker, parameters
held per worker, wall time, and steps, seconds and bytes to a target; the table
(``compare.md``) and the plots go to ``OUT/report``, a directory thinwire creates and marks
(:func:`thinwire.rundir.open_output_dir`; one it did not create is refused, never written). A method is a registered method name or a shorthand one declares (a codec's name
for compressed dp), optionally with options after a colon: ``ist:local_steps=20,switch_at=400``;
options of other sections take their dotted name: ``ist:train.schedule=cosine``.

Beside the table, the time to the target at 100 Mbit/s and 1 Gbit/s per method
(``OUT/report/thin_links.md`` and ``accuracy_vs_time_thin_links.png``): measured on the
thin-wire testbed when it can be built (root, iproute2; each method rerun until the step its
loopback run reached the target at, ``--thin-links-timeout`` bounding all of them, run
directories under ``OUT/thin_links``), else modelled from the loopback runs, with the reason
(:mod:`thinwire.testbed.thin_links`); ``--thin-links modelled`` always models.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from thinwire.commands.common import add_common, add_config_options, metric_of, overrides
from thinwire.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, names=False)
    parser.add_argument("--methods", default="dp,localsgd,ist",
                        help="comma-separated method specs, e.g. dp,localsgd,"
                             "ist:local_steps=20,train.lr=0.1,topk:ratio=0.01 "
                             "(default: dp,localsgd,ist)")
    parser.add_argument("--target", type=float, default=None,
                        help="metric value for the to-target columns (default: the best value "
                             "every run reached)")
    parser.add_argument("--thin-links", choices=("auto", "modelled"), default="auto",
                        help="time to the target at 100 Mbit/s and 1 Gbit/s: auto = measured on "
                             "the thin-wire testbed when it can be built (root, iproute2), else "
                             "modelled from these runs; modelled = always modelled (default: auto)")
    parser.add_argument("--thin-links-timeout", type=float, default=600.0,
                        help="wall-clock limit of the testbed runs, seconds; past it the figures "
                             "are modelled (default: 600)")
    add_config_options(parser, skip=("method.name", "run.name"))


def run(args: argparse.Namespace) -> int:
    from thinwire.report.plots import plot_runs
    from thinwire.report.tables import check_target, compare_table, load_run
    from thinwire.run import method_configs, run_config, split_methods
    from thinwire.rundir import check_out, open_output_dir, write_text

    check_target(args.target)
    if not 0 < args.thin_links_timeout <= 24 * 3600:
        raise UsageError(f"--thin-links-timeout {args.thin_links_timeout:g}: use a positive "
                         "number of seconds (at most 86400)")
    cfgs = method_configs(split_methods(args.methods), args.config, overrides(args))
    for cfg in cfgs:
        check_target(args.target, metric_of(cfg))
    report_dir = check_out(cfgs[0].run.out) / "report"
    open_output_dir(report_dir, "compare (OUT/report)")  # refused before anything trains
    for cfg in cfgs:
        print(f"== {cfg.run_name}: {cfg.runtime.workers} workers, {cfg.train.steps} steps",
              flush=True)
        run_config(cfg)
    runs = [load_run(c.run_dir) for c in cfgs]
    table = compare_table(runs, args.target)
    print(table)
    write_text(report_dir / "compare.md", table + "\n")
    for p in plot_runs(runs, report_dir):
        print(f"wrote {p}")
    _thin_links(cfgs, runs, args.target, report_dir, args.thin_links, args.thin_links_timeout)
    return 0


def _regimes(cfgs: list[Any], runs: list[Any], results: list[Any], links: list[Any],
             target: float) -> str:
    """For every method fastest on no link: the regime where it wins, from its registry entry
    (``MethodEntry.regime``), so the table it lost says so plainly and names where it
    wins."""
    from thinwire.strategies import METHODS
    from thinwire.testbed import thin_links as tl

    won = {tl.fastest([r for r in results if r.link == lk], target) for lk in links}
    lines = []
    for cfg, run in zip(cfgs, runs):
        method = getattr(cfg, "method", None)
        regime = METHODS.get(method.name).regime if method is not None else ""
        if run.label not in won and regime:
            lines.append(f"{run.label} is not the fastest here; it wins {regime}.")
    return "\n" + "\n".join(lines) if lines else ""


def _thin_links(cfgs: list[Any], runs: list[Any], target: float | None, report_dir: Path,
                requested: str, timeout_s: float) -> None:
    """Beside the table: time to the target at 100 Mbit/s and 1 Gbit/s, measured on the
    testbed when it can be built, else modelled from these runs
    (:mod:`thinwire.testbed.thin_links`), and the metric against that time."""
    import time

    from thinwire.report.tables import common_target
    from thinwire.rundir import write_text
    from thinwire.testbed import thin_links as tl
    from thinwire.testbed.netns import unavailable_reason
    from thinwire.testbed.rates import parse_links

    target = common_target(runs) if target is None else target
    links = parse_links(tl.THIN_LINKS)
    source, why = tl.choose_source(requested,
                                   unavailable_reason() if requested == "auto" else None)
    results: list[Any] = []
    if source == "measured":
        print(f"\n== thin links: each method on the testbed at "
              f"{', '.join(lk.label for lk in links)} until the step it reached {target:.3f} at "
              f"(limit {timeout_s:g} s)", flush=True)
        results, stopped = tl.measured(cfgs, runs, target, links,
                                       report_dir.parent / "thin_links",
                                       time.monotonic() + timeout_s)
        if stopped:
            why = f"the testbed stopped early ({stopped})"
            results = []
    if not results:
        results = tl.modelled(runs, links)
    text, plot = tl.report(results, target, report_dir, why)
    text += _regimes(cfgs, runs, results, links, target)
    print(f"\n{text}")
    write_text(report_dir / "thin_links.md", text + "\n")
    print(f"wrote {plot}")
