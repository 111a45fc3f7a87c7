"""``thinwire compare``: several methods on the same data, model and workers, one table.

``--methods dp,localsgd,ist`` (default) runs each method in turn with the same config and
prints: test accuracy and NLL, bytes sent per worker, parameters held per worker, wall time, and
steps, seconds and bytes to a target accuracy; plots go to ``OUT/report``. A method is a name
from ``method.name`` (dp, localsgd, diloco, ist) or a compressor for compressed data parallelism
(topk, randk, qsgd, int8, fp16, bf16, sign, powersgd), optionally with options after a colon:
``ist:local_steps=20,switch_at=400``; options of other sections take their dotted name:
``ist:train.schedule=cosine``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from thinwire import config as config_mod
from thinwire.commands.common import add_common, overrides, run_config
from thinwire.config import COMPRESSORS, METHODS, MethodConfig
from thinwire.errors import UsageError


def method_overrides(spec: str) -> dict[str, Any]:
    """``"topk"`` -> dp with the topk compressor; ``"ist:local_steps=20"`` -> ist with K = 20."""
    name, _, opts = spec.strip().partition(":")
    out: dict[str, Any] = {}
    if name in METHODS:
        out["method.name"] = name
    elif name in COMPRESSORS and name != "none":
        out.update({"method.name": "dp", "method.compressor": name})
    else:
        raise UsageError(f"unknown method {name!r}; use one of "
                         f"{', '.join(METHODS + COMPRESSORS[1:])}")
    known = {f.name for f in dataclasses.fields(MethodConfig)}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if eq and "." in key:  # any other option of this run, e.g. train.schedule=cosine
            out[key] = value
            continue
        if not eq or key not in known:
            raise UsageError(f"method option {item!r} in {spec!r}: use KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(known))}, or SECTION.OPTION=VALUE")
        out[f"method.{key}"] = value
    return out


def run_name(spec: str) -> str:
    return spec.replace(":", "_").replace(",", "_").replace("=", "").replace(".", "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    add_common(parser)
    parser.add_argument("--methods", default="dp,localsgd,ist",
                        help="comma-separated methods: " + ", ".join(METHODS + COMPRESSORS[1:])
                             + "; a method's options follow a colon, comma-separated, e.g. "
                               "ist:local_steps=20,train.lr=0.1")
    parser.add_argument("--target", type=float, default=None,
                        help="accuracy for the to-target columns (default: highest all reached)")
    config_mod.add_override_options(parser, skip=("method.name", "run.name"))


def split_methods(text: str) -> list[str]:
    """Split on commas that start a new method (a method's own options also use commas)."""
    out: list[str] = []
    for part in text.split(","):
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part
        else:
            out.append(part)
    return [m for m in out if m]


def run(args: argparse.Namespace) -> int:
    from thinwire.report.plots import plot_runs
    from thinwire.report.tables import compare_table, load_run

    base = overrides(args)
    specs = split_methods(args.methods)
    cfgs = []
    for spec in specs:  # validate everything before training anything
        cfgs.append(config_mod.load(args.config, {**base, **method_overrides(spec),
                                                  "run.name": run_name(spec)}))
    for cfg in cfgs:
        print(f"== {cfg.run_name}: {cfg.runtime.workers} workers, {cfg.train.steps} steps", flush=True)
        run_config(cfg)
    runs = [load_run(c.run_dir) for c in cfgs]
    table = compare_table(runs, args.target)
    print(table)
    out = Path(cfgs[0].run.out)
    (out / "compare.md").write_text(table + "\n")
    for p in plot_runs(runs, out / "report"):
        print(f"wrote {p}")
    return 0
