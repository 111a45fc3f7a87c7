"""``thinwire compare``: several methods on the same data, model and workers, one table.

``--methods dp,localsgd,ist`` (default) runs each method in turn with the same config and
prints: the task's metric (accuracy, or perplexity) and NLL, bytes sent per worker, parameters
held per worker, wall time, and steps, seconds and bytes to a target; the table
(``compare.md``) and the plots go to ``OUT/report``, a directory thinwire creates and marks
(:func:`thinwire.rundir.open_output_dir`; one it did not create is refused, never written). A method is a registered method name or a shorthand one declares (a codec's name
for compressed dp), optionally with options after a colon: ``ist:local_steps=20,switch_at=400``;
options of other sections take their dotted name: ``ist:train.schedule=cosine``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from thinwire.commands.common import add_common, add_config_options, overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser, names=False)
    parser.add_argument("--methods", default="dp,localsgd,ist",
                        help="comma-separated method specs, e.g. dp,localsgd,"
                             "ist:local_steps=20,train.lr=0.1,topk:ratio=0.01 "
                             "(default: dp,localsgd,ist)")
    parser.add_argument("--target", type=float, default=None,
                        help="metric value for the to-target columns (default: the best value "
                             "every run reached)")
    add_config_options(parser, skip=("method.name", "run.name"))


def run(args: argparse.Namespace) -> int:
    from thinwire.report.plots import plot_runs
    from thinwire.report.tables import check_target, compare_table, load_run
    from thinwire.run import method_configs, run_config, split_methods
    from thinwire.rundir import check_out, open_output_dir, write_text

    check_target(args.target)
    cfgs = method_configs(split_methods(args.methods), args.config, overrides(args))
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
    _thin_links(runs, args.target, report_dir)
    return 0


def _thin_links(runs: list[Any], target: float | None, report_dir: Path) -> None:
    """Beside the table: time to the target at 100 Mbit/s and 1 Gbit/s, modelled from these
    runs (:mod:`thinwire.testbed.thin_links`), and the metric against that time."""
    from thinwire.report.tables import common_target
    from thinwire.rundir import write_text
    from thinwire.testbed.thin_links import report

    text, plot = report(runs, common_target(runs) if target is None else target, report_dir)
    print(f"\n{text}")
    write_text(report_dir / "thin_links.md", text + "\n")
    print(f"wrote {plot}")
