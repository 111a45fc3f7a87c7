"""The ``--crossover`` and ``--scaling`` modes of ``thinwire plan``: pure planner modes.

Crossover and knee definitions are in insight.py; this module turns the modes' options (plain
values, as ``thinwire plan`` parses them) into calls and their results into text or JSON-ready
dicts. The methods compared are the
planner's data-parallel layout and every registered method at its defaults, plus ``--method``
when it names another (:func:`thinwire.planner.insight.method_variants`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.planner.insight import (
    BASELINE,
    LINKS,
    crossover_bandwidth,
    knee,
    method_variants,
    plot_scaling,
    scaling,
    step_at,
)
from thinwire.planner.render import rate, table
from thinwire.planner.report import crossover_report, method_label
from thinwire.planner.specs import ClusterSpec, ModelSpec
from thinwire.planner.strategy import StrategySpec


def _extra(method: str) -> tuple[str, ...]:
    """The ``--method`` spec to compare beside the defaults (none for the planner's layout)."""
    return (method,) if method else ()


def _penalties(text: str, keys: list[str]) -> dict[str, float]:
    """``ist=2,localsgd=1.5`` -> {compared method: factor}; a name matches a compared spec or
    its method name (the part before ':')."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.rpartition("=")
        try:
            factor = float(value)
        except ValueError:
            raise UsageError(f"--penalty {part!r}: write method=factor, e.g. ist=2") from None
        matches = [k for k in keys if name in (k, k.partition(":")[0])]
        if not matches or factor <= 0:
            raise UsageError(f"--penalty {part!r}: method one of {', '.join(keys)}, factor > 0")
        out.update(dict.fromkeys(matches, factor))
    return out


def crossover_mode(
    model: ModelSpec, cluster: ClusterSpec, base: StrategySpec, *, method: str = "",
    penalty: str = "", as_json: bool = False
) -> str | dict[str, Any]:
    """``--crossover``: step times per link speed and the crossover bandwidths (``method``: a
    spec compared beside the defaults; ``penalty``: ``ist=2,...``; ``as_json``: a dict)."""
    variants = method_variants(model, base, _extra(method))
    methods = [k for k in variants if k != BASELINE]
    penalties = _penalties(penalty, methods)
    links = sorted(set(LINKS) | {cluster.inter_bandwidth})
    rows, data = [], []
    for w in links:
        t_dp = step_at(model, cluster, variants[BASELINE], w)
        times = {k: step_at(model, cluster, variants[k], w) for k in methods}
        rows.append(
            [rate(w), f"{t_dp:.3g}"] + [f"{times[k]:.3g} ({t_dp / times[k]:.3g})" for k in methods]
        )
        data.append({"bandwidth_bytes_per_s": w, BASELINE: t_dp, **times})
    cross = {
        k: crossover_bandwidth(
            model, cluster, variants[BASELINE], variants[k], penalties.get(k, 1.0)
        )
        for k in methods
    }
    if as_json:
        finite = {k: (None if math.isinf(w) else w) for k, w in cross.items()}  # None: always wins
        labels = {k: method_label(variants[k]) for k in methods}
        return {"rows": data, "crossover_bytes_per_s": finite, "penalties": penalties,
                "labels": labels}
    return crossover_report(rows, methods, cross, penalties, cluster, variants)


def _scaling_rows(points: list[Any]) -> list[list[object]]:
    return [
        [q.method, q.workers, f"{q.step_time:.4g}", f"{q.samples_per_s:.4g}", f"{q.comm:.3g}",
         f"{q.compute:.3g}", f"{100 * q.efficiency:.0f}%"]
        for q in points
    ]


def scaling_mode(
    model: ModelSpec, cluster: ClusterSpec, base: StrategySpec, *, out: str | None, max_workers: int,
    global_batch: int = 0, weak: bool = False, method: str = "", as_json: bool = False
) -> str | dict[str, Any]:
    """``--scaling``: step time and throughput against 1, 2, 4, ... ``max_workers`` workers,
    the knee, a PNG in ``out`` (``global_batch`` 0: the model's; ``weak``: the batch grows with
    the workers)."""
    if not out:
        raise UsageError("--scaling writes a PNG: add --out DIR")
    workers = [2**i for i in range(0, 31) if 2**i <= max(1, max_workers)]
    batch = global_batch or model.global_batch
    points = scaling(model, cluster, base, workers, batch, weak=weak, extra=_extra(method))
    if not points:
        raise UsageError(
            "no worker count fits the batch; lower --micro-batch-size or raise --global-batch"
        )
    path = plot_scaling(points, Path(out), f"{model.name} on {cluster.name}")
    bend = knee(points)
    if as_json:
        return {"png": str(path), "knee_workers": bend,
                "points": [dataclasses.asdict(q) for q in points]}
    scaling_kind = "weak" if weak else f"strong, global batch {batch}"
    text = table(
        ["method", "workers", "step s", "samples/s", "sync s", "compute s", "efficiency"],
        _scaling_rows(points),
        f"Data-parallel scaling ({scaling_kind})",
    )
    verdict = (
        f"Data-parallel knee: parallel efficiency falls below 50% at {bend} workers"
        if bend
        else "Data parallelism keeps >= 50% efficiency over this range"
    )
    return f"{text}\n\n{verdict}\nwrote {path}\n"
