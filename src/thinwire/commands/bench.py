"""``thinwire bench``: train methods on workers joined by really thin links, or model them.

``thinwire bench --link 100mbit,1gbit,unlimited --workers 4 --methods dp,localsgd,ist`` builds,
for every run, one network namespace per worker on a bridge with ``tc`` shaping each link
(:mod:`thinwire.testbed.netns`), runs the workers inside, and prints per link and method: wall
time and bytes to a target accuracy (measured), and the measured wire bytes beside the ledger's
payload and estimated wire bytes. Results go to ``OUT/bench.md``, ``OUT/bench.json`` and the plot
``OUT/accuracy_vs_wall.png``; each run's directory is ``OUT/<link>/<method>``.

Without namespaces (not root, no iproute2, ``ip netns add`` failing) or with ``--modelled`` the
methods run over loopback and wall times are *modelled* (:mod:`thinwire.testbed.modelled`);
the reason is printed, and every modelled figure says so. ``--timeout`` bounds the whole bench.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from thinwire import config as config_mod
from thinwire.commands.common import add_common, add_config_options, metric_of, overrides
from thinwire.config import Config
from thinwire.errors import UsageError
from thinwire.testbed.rates import Link, parse_links


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link", default="100mbit",
                        help="link rates, comma-separated: e.g. 100mbit,1gbit,unlimited (default: 100mbit)")
    parser.add_argument("--delay", default="0",
                        help="one-way delay of each link direction, e.g. 5ms (needs netem; default: 0)")
    parser.add_argument("--methods", default="dp,localsgd,ist",
                        help="comma-separated methods as in thinwire compare, e.g. "
                             "dp,localsgd,ist:local_steps=20,topk (default: dp,localsgd,ist)")
    parser.add_argument("--target", type=float, default=None,
                        help="metric value for the to-target columns (default: the best all reached)")
    parser.add_argument("--modelled", action="store_true",
                        help="no namespaces: run over loopback and model the link")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="hard wall-clock limit of the whole bench, seconds (default: 3600)")
    add_common(parser, names=False)
    parser.set_defaults(out="runs/bench")
    add_config_options(parser, skip=("method.name", "run.name", "run.out", "run.resume"))


def _configs(args: argparse.Namespace, groups: list[str]) -> dict[str, list[Config]]:
    """Validated configs, one per (group, method); groups are link labels or 'modelled'."""
    from thinwire.run import method_configs, split_methods

    base: dict[str, Any] = overrides(args)
    base["run.progress"] = False
    specs = split_methods(args.methods)
    workers = config_mod.load(args.config, base).runtime.workers
    base.setdefault("runtime.threads", max(1, (os.cpu_count() or 1) // workers))
    return {g: method_configs(specs, args.config, {**base, "run.out": str(Path(args.out) / g)})
            for g in groups}


def run(args: argparse.Namespace) -> int:
    from thinwire.testbed.netns import unavailable_reason

    links = parse_links(args.link, args.delay)
    if not 0 < args.timeout <= 7 * 24 * 3600:
        raise UsageError(f"--timeout {args.timeout}: use a positive number of seconds")
    reason = None if args.modelled else unavailable_reason()
    if reason:
        print(f"thinwire bench: no network namespaces ({reason}); falling back to modelled mode: "
              "methods run over loopback, wall times are modelled", flush=True)
    modelled = args.modelled or reason is not None
    groups = ["modelled"] if modelled else [lk.label for lk in links]
    cfgs = _configs(args, groups)
    from thinwire.report.tables import check_target

    for cfg in cfgs[groups[0]]:
        check_target(args.target, metric_of(cfg))
    from thinwire.run import preflight

    preflight(next(iter(cfgs.values()))[0])
    from thinwire.testbed import bench

    results, stopped = bench.run_all(cfgs, links, time.monotonic() + args.timeout,
                                     modelled=modelled)
    if stopped:
        if results:
            print(f"partial results ({len(results)} runs finished):")
            _write(results, args, Path(args.out))
        raise SystemExit(f"thinwire bench: {stopped}")
    _write(results, args, Path(args.out))
    return 0


def _write(results: list[Any], args: argparse.Namespace, out: Path) -> None:
    from thinwire.testbed.report import bench_table, common_target, plot_bench

    target = args.target if args.target is not None else common_target(results)
    table = bench_table(results, target)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(table + "\n")
    rows = [{"link": asdict(r.link), "link_label": r.link.label, "method": r.method,
             "kind": r.kind, "wall_s": r.wall_s, "curve": r.curve, "run_dir": str(r.run.path),
             "to_target": r.to_target(target),
             "wire": asdict(r.wire) if r.wire is not None else None} for r in results]
    (out / "bench.json").write_text(json.dumps({"target": target, "results": rows}, indent=1))
    print(f"wrote {plot_bench(results, target, out / 'accuracy_vs_wall.png')}")


__all__ = ["Link", "add_arguments", "run"]
