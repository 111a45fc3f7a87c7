"""The ``--crossover`` and ``--scaling`` modes of ``thinwire plan``: pure planner modes.

Crossover and knee definitions are in insight.py; this module turns the modes' options (plain
values, as ``thinwire plan`` parses them) into calls and their results into text or JSON-ready
dicts. The methods compared are the
planner's own data parallelism and every registered method at its defaults, plus ``--method``
when it names another (:func:`thinwire.planner.insight.method_variants`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.planner.convergence import Convergence
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
from thinwire.planner.specs import ClusterSpec, MLPSpec, ModelSpec
from thinwire.planner.strategy import StrategySpec


def _extra(method: str) -> tuple[str, ...]:
    """The ``--method`` spec to compare beside the defaults (none for the planner's own data parallelism)."""
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
    penalty: str = "", as_json: bool = False, convergence: Sequence[str] = (), target: str = "",
    command_line: str = ""
) -> str | dict[str, Any]:
    """``--crossover``: step times per link speed and the crossover bandwidths (``method``: a
    spec compared beside the defaults; ``penalty``: ``ist=2,...``; ``as_json``: a dict).
    With ``convergence`` (sources of :func:`thinwire.planner.convergence.load`), first the
    time to each target (``target``: ``0.8,0.83``; default the table's) per link speed and
    the winner (:mod:`thinwire.planner.crossover`); the per-step comparison follows, labelled
    as such."""
    per_step = _per_step(model, cluster, base, method, penalty, as_json)
    if not convergence:
        if target:
            raise UsageError("--target needs --convergence RUN_DIR...|FILE.json|NAME (the steps "
                             "each method takes to it); shipped tables: "
                             + ", ".join(_shipped()))
        return per_step
    from thinwire.planner.convergence import load

    conv = load(list(convergence), _targets(target), fit_command=command_line)
    to_target = target_mode(conv, model, cluster, base, as_json)
    if as_json:
        return {"to_target": to_target, "per_step": per_step}
    return f"{to_target}\n{per_step}"


def _per_step(model: ModelSpec, cluster: ClusterSpec, base: StrategySpec, method: str,
              penalty: str, as_json: bool) -> str | dict[str, Any]:
    """Step times per link speed and the per-step crossover bandwidths."""
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


def _shipped() -> list[str]:
    from thinwire.planner.convergence import shipped

    return shipped() or ["none"]


def _targets(text: str | None) -> list[float]:
    """``--target 0.8,0.83`` -> [0.8, 0.83] (none: the table's own targets)."""
    text = text or ""
    out = []
    for part in filter(None, (t.strip() for t in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            raise UsageError(f"--target {part!r}: write the metric's value, e.g. 0.83 (accuracy) "
                             "or 12.5 (perplexity); several comma-separated") from None
        if not math.isfinite(value):
            raise UsageError(f"--target {part!r}: give a finite number")
        out.append(value)
    return out


def _what(conv: Convergence, target: float) -> str:
    return f"{conv.metric} {target:g}"


def _steps_cell(conv: Convergence, spec: str, target: float) -> str:
    steps = conv.steps(spec, target)
    if steps is None:
        return "does not reach"
    f = conv.factor(spec, target)
    return f"{steps:.4g}" + (f" ({f:.3g}x dp)" if f is not None and spec != conv.baseline else "")


def _setting(conv: Convergence) -> str:
    return (f"{conv.family} on {conv.dataset}, {conv.workers} workers, batch "
            f"{conv.batch_size} per worker")


def target_mode(conv: Convergence, model: ModelSpec, cluster: ClusterSpec, base: StrategySpec,
                as_json: bool = False) -> str | list[dict[str, Any]]:
    """Time to each of the table's targets per link speed: planner step time x the runs' steps,
    the winner per link and per link range, "does not reach" where no run got there."""
    from thinwire.planner.crossover import (
        describe_ranges,
        priced,
        times_at,
        winner,
        winner_ranges,
    )

    p = priced(model, cluster, base, conv)
    if not p.variants:
        raise UsageError("--convergence: the planner prices none of the table's methods on this "
                         "model: " + "; ".join(p.unpriced.values()))
    keys = list(p.variants)
    links = sorted(set(LINKS) | {cluster.inter_bandwidth})
    blocks, data = [], []
    for target in conv.targets:
        rows, jrows = [], []
        for w in links:
            times = times_at(model, cluster, p, conv, target, w)
            best = winner(times)
            rows.append([rate(w)] + [f"{t:.4g}" if t is not None else "does not reach"
                                     for t in times.values()]
                        + [p.labels[best] if best else "none reaches it"])
            jrows.append({"bandwidth_bytes_per_s": w, "seconds": times, "winner": best})
        ranges = winner_ranges(model, cluster, p, conv, target)
        what = _what(conv, target)
        data.append({"target": target, "metric": conv.metric, "rows": jrows,
                     "steps": {k: conv.steps(k, target) for k in keys},
                     "ranges": [{"from_bytes_per_s": a, "to_bytes_per_s": b, "winner": k}
                                for a, b, k in ranges]})
        text = table(["link"] + [f"{p.labels[k]} s" for k in keys] + ["winner"], rows,
                     f"Time to {what} on {cluster.name} ({cluster.devices} devices): planner step "
                     "time x steps to the target in the runs")
        steps = ", ".join(f"{p.labels[k]} {_steps_cell(conv, k, target)}" for k in keys)
        blocks.append(f"{text}\nsteps to {what}: {steps}\n"
                      f"{describe_ranges(ranges, p.labels, what)}\n")
    if as_json:
        return data
    head = [f"Steps from runs of {_setting(conv)}"
            + (f" ({conv.provenance})" if conv.provenance else "")]
    hidden = "-".join([model.name.partition("-")[0], *map(str, model.widths[1:-1])]
                      ) if isinstance(model, MLPSpec) else ""
    if conv.family not in (model.name, hidden) or cluster.devices != conv.workers:
        head.append(f"(the plan is {model.name} on {cluster.devices} devices: the runs' steps "
                    "applied to it are an extrapolation)")
    head += [f"{k}: not priced here ({why})" for k, why in p.unpriced.items()]
    return "\n".join(head) + "\n\n" + "\n".join(blocks) + "\nPer step (not time to a target):\n"


def convergence_mode(sources: Sequence[str], *, target: str = "", out: str | None = None,
                     as_json: bool = False, command_line: str = "") -> str | dict[str, Any]:
    """``--convergence`` alone: the fitted steps to each target and factors against data
    parallelism; ``out`` (FILE.json) writes the table."""
    from thinwire.planner.convergence import load

    conv = load(list(sources), _targets(target), fit_command=command_line)
    wrote = ""
    if out:
        path = Path(out)
        if path.suffix != ".json":
            raise UsageError(f"--out {path}: --convergence writes a JSON table, e.g. --out "
                             "runs/convergence.json")
        import json

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(conv.to_json(), indent=1) + "\n")
        except OSError as exc:
            raise UsageError(f"--out {path}: cannot write it ({exc.strerror}); pick a writable "
                             "path") from None
        wrote = f"wrote {path}\n"
    if as_json:
        return conv.to_json()
    order = "higher is better" if conv.higher_is_better else "lower is better"
    rows = [[m.label, m.runs, m.steps_run, f"{m.best:.4g}"]
            + [_steps_cell(conv, m.spec, t) for t in conv.targets] for m in conv.methods]
    text = table(["method", "runs", "steps run", f"best {conv.metric}"]
                 + [f"steps to {t:g}" for t in conv.targets], rows,
                 f"Steps to target ({conv.metric}, {order}): {_setting(conv)}")
    prov = f"runs made by: {conv.provenance}\n" if conv.provenance else ""
    return (f"{text}\n\n(x dp) = steps relative to data parallelism's; does not reach = none "
            f"of the method's runs got there (never a winner)\n{prov}{wrote}")
