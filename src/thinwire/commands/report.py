"""``thinwire report RUN_DIR...``: print the comparison and memory tables and write plots."""

from __future__ import annotations

import argparse
from pathlib import Path

from thinwire.report.plots import plot_runs
from thinwire.report.tables import check_target, compare_table, load_run, memory_table
from thinwire.rundir import open_output_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    parser.add_argument("--target", type=float, default=None,
                        help="accuracy for the time/bytes-to-target columns "
                             "(default: the highest accuracy every run reached)")
    parser.add_argument("--plots", metavar="DIR", default=None,
                        help="where to write accuracy.png and loss.png: a new directory, or one thinwire "
                             "made for plots before (default: RUNS/report beside the first run)")


def run(args: argparse.Namespace) -> int:
    check_target(args.target)
    runs = [load_run(p) for p in args.runs]
    check_target(args.target, runs[0].metric if runs else None)
    out = open_output_dir(Path(args.plots) if args.plots else Path(args.runs[0]).parent / "report",
                          "--plots")
    print(compare_table(runs, args.target))
    print()
    print(memory_table(runs))
    for p in plot_runs(runs, out):
        print(f"wrote {p}")
    return 0
