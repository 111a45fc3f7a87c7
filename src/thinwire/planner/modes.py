"""The ``--crossover`` and ``--scaling`` modes of ``thinwire plan``: compute, then format.

Crossover and knee definitions are in insight.py; this module turns the command-line arguments
into calls and their results into text or JSON-ready dicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.planner.insight import (
    LINKS,
    crossover_bandwidth,
    knee,
    method_variants,
    plot_scaling,
    scaling,
    step_at,
)
from thinwire.planner.render import rate, table
from thinwire.planner.report import crossover_report
from thinwire.planner.specs import METHODS, ClusterSpec, ModelSpec
from thinwire.planner.strategy import StrategySpec


def _penalties(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise UsageError(f"--penalty {part!r}: write method=factor, e.g. ist=2") from None
        if name not in METHODS or out[name] <= 0:
            raise UsageError(f"--penalty {part!r}: method one of {', '.join(METHODS)}, factor > 0")
    return out


def crossover_mode(
    args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec, base: StrategySpec
) -> str | dict[str, Any]:
    """``--crossover``: step times per link speed and the crossover bandwidths."""
    variants = method_variants(base)
    penalties = _penalties(args.penalty)
    methods = [k for k in variants if k != "dp"]
    links = sorted(set(LINKS) | {cluster.inter_bandwidth})
    rows, data = [], []
    for w in links:
        t_dp = step_at(model, cluster, variants["dp"], w)
        times = {k: step_at(model, cluster, variants[k], w) for k in methods}
        rows.append(
            [rate(w), f"{t_dp:.3g}"] + [f"{times[k]:.3g} ({t_dp / times[k]:.3g})" for k in methods]
        )
        data.append({"bandwidth_bytes_per_s": w, "dp": t_dp, **times})
    cross = {
        k: crossover_bandwidth(model, cluster, variants["dp"], variants[k], penalties.get(k, 1.0))
        for k in methods
    }
    if args.json:
        finite = {k: (None if math.isinf(w) else w) for k, w in cross.items()}  # None: always wins
        return {"rows": data, "crossover_bytes_per_s": finite, "penalties": penalties}
    return crossover_report(rows, methods, cross, penalties, cluster, variants)


def scaling_mode(
    args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec, base: StrategySpec
) -> str | dict[str, Any]:
    """``--scaling``: step time and throughput against workers, the knee, a PNG."""
    if not args.out:
        raise UsageError("--scaling writes a PNG: add --out DIR")
    workers = [2**i for i in range(0, 31) if 2**i <= max(1, args.max_workers)]
    batch = args.global_batch or model.global_batch
    points = scaling(model, cluster, base, workers, batch, weak=args.weak)
    if not points:
        raise UsageError(
            "no worker count fits the batch; lower --micro-batch-size or raise --global-batch"
        )
    path = plot_scaling(points, Path(args.out), f"{model.name} on {cluster.name}")
    bend = knee(points)
    if args.json:
        return {
            "png": str(path),
            "knee_workers": bend,
            "points": [dataclasses.asdict(q) for q in points],
        }
    rows = [
        [
            q.method,
            q.workers,
            f"{q.step_time:.4g}",
            f"{q.samples_per_s:.4g}",
            f"{q.comm:.3g}",
            f"{q.compute:.3g}",
            f"{100 * q.efficiency:.0f}%",
        ]
        for q in points
    ]
    text = table(
        ["method", "workers", "step s", "samples/s", "sync s", "compute s", "efficiency"],
        rows,
        "Data-parallel scaling ("
        + ("weak" if args.weak else f"strong, global batch {batch}")
        + ")",
    )
    verdict = (
        f"DP knee: parallel efficiency falls below 50% at {bend} workers"
        if bend
        else "DP keeps >= 50% efficiency over this range"
    )
    return f"{text}\n\n{verdict}\nwrote {path}\n"
