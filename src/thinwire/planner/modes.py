"""The ``--crossover``, ``--scaling`` and ``--calibrate`` modes of ``thinwire plan``.

Crossover and knee definitions are in insight.py, calibration in calibrate.py; this module turns
the command-line arguments into calls and their results into text or JSON-ready dicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Sequence
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
from thinwire.planner.presets import load_model
from thinwire.planner.render import rate, table
from thinwire.planner.report import crossover_report
from thinwire.planner.specs import METHODS, ClusterSpec, MLPSpec, ModelSpec
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


CALIBRATE_MODEL = "mlp-784-512-512-10"


def _md(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table, numbers right-aligned."""
    out = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(["---"] + ["--:"] * (len(headers) - 1)) + "|",
    ]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def calibrate_mode(args: argparse.Namespace) -> str | dict[str, Any]:
    """``--calibrate``: per run of the suite, calibrate, run, calibrate again; predicted
    against measured (bytes exactly, step time) as markdown, written to ``--out``."""
    from thinwire.planner import calibrate as cb
    from thinwire.run import run_config
    from thinwire.trainer import load_data

    model = load_model(args.model or CALIBRATE_MODEL)
    if not isinstance(model, MLPSpec):
        raise UsageError("--calibrate trains an MLP: give --model mlp-784-H-...-10")
    widths, n = model.widths, args.workers or 4
    steps, batch = args.steps or 100, args.micro_batch_size or 128
    out = Path(args.out or "runs/calibrate")
    configs = cb.suite(widths, n, steps, batch, str(out / "runs"))
    start = time.perf_counter()
    cb.preimport()
    ds = load_data(configs[0])
    probe = dataclasses.replace(cb.probe_for(configs, widths), data=(ds.x_train, ds.y_train))
    print("thinwire plan --calibrate: calibrating", file=sys.stderr)
    cals = [cb.calibrate(probe, n)]
    results = []
    for cfg in configs:  # run, calibrate again: each run lies between two calibrations
        print(
            f"thinwire plan --calibrate: running {cfg.run_name}, then calibrating", file=sys.stderr
        )
        summary = run_config(cfg)
        cals.append(cb.calibrate(probe, n))
        before, after = cals[-2:]
        t_end = (cfg.run_dir / "summary.json").stat().st_mtime  # written after the last step
        cal = cb.bracket(before, after, t_end - summary["wall_s"] / 2)
        results.append(
            {
                "run": cfg.run_name,
                "predicted": cb.predict(cfg, widths, cal),
                "measured": cb.measured(summary, str(cfg.run_dir)),
                "drift": after.compute_flops_per_s / before.compute_flops_per_s - 1,
                "calibration": cb.calibration_json(cal),
            }
        )
    data = {
        "command": f"thinwire plan --calibrate --model {model.name} --workers {n} "
        f"--steps {steps} --micro-batch-size {batch} --out {shlex.quote(str(out))}",
        "model": model.name,
        "workers": n,
        "steps": steps,
        "batch_size": batch,
        "cores": os.cpu_count(),
        "seconds": time.perf_counter() - start,
        "runs": results,
    }
    text = calibration_report(data)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.md").write_text(text)
    (out / "calibration.json").write_text(json.dumps(data, indent=2, default=str))
    return data if args.json else text + f"\nwrote {out / 'calibration.md'}\n"


def calibration_report(data: dict[str, Any]) -> str:
    """The predicted-against-measured table and the constants behind each prediction."""
    rows, consts = [], []
    for r in data["runs"]:
        p, m, c = r["predicted"], r["measured"], r["calibration"]
        same = all(
            p[k] == m[k]
            for k in ("sent_per_worker_mean", "sent_per_worker_max", "payload_per_worker_mean")
        )
        err = p["step_time_s"] / m["step_time_s"] - 1
        rows.append(
            [
                r["run"],
                f"{p['sent_per_worker_mean']:,.0f}",
                f"{m['sent_per_worker_mean']:,.0f}",
                f"{p['sent_per_worker_max']:,.0f}",
                f"{m['sent_per_worker_max']:,.0f}",
                "exact" if same else "DIFFERENT",
                f"{1e3 * p['step_time_s']:.1f}",
                f"{1e3 * m['step_time_s']:.1f}",
                f"{100 * err:+.1f}%",
                " / ".join(
                    f"{1e3 * p[k]:.1f}" for k in ("compute_time_s", "comm_time_s", "codec_time_s")
                ),
                f"{100 * m['spread']:.0f}%",
                f"{100 * r['drift']:+.0f}%",
            ]
        )
        link = ", ".join(
            f"{k} {1e6 * f['alpha_s']:.0f} us + "
            + (f"{f['bytes_per_s'] / 1e6:,.0f} MB/s" if f["bytes_per_s"] < 1e13 else "inf")
            for k, f in c["links"].items()
        )
        extra = (
            f"{1e3 * c['ist_round_s']:.1f} ms/round"
            if r["run"] == "ist"
            else f"{c['codec_bytes_per_s'] / 1e6:,.0f} MB/s"
            if "topk" in r["run"]
            else "-"
        )
        consts.append(
            [
                r["run"],
                f"{c['compute_flops_per_s'] / 1e9:.2f}",
                f"{1e3 * c['step_overhead_s']:.2f}",
                link,
                extra,
                f"{r['predicted']['straggler']:.2f}",
                f"{1e3 * c['ddp_bucket_s']:.1f}" if c["ddp_bucket_s"] else "-",
                f"{100 * c['spread']:.0f}%",
                f"{c['load_average']:.1f}",
            ]
        )
    errors = [
        abs(r["predicted"]["step_time_s"] / r["measured"]["step_time_s"] - 1) for r in data["runs"]
    ]
    head = (
        f"Predicted against measured: {data['model']}, {data['workers']} workers on "
        f"{data['cores']} cores, batch {data['batch_size']} per worker, {data['steps']} steps"
    )
    table_1 = _md(
        [
            "run",
            "sent B/worker pred",
            "measured",
            "rank 0 sent pred",
            "measured",
            "bytes",
            "step ms pred",
            "measured",
            "error",
            "pred compute / comm / codec ms",
            "run spread",
            "cal. drift",
        ],
        rows,
    )
    table_2 = _md(
        [
            "run",
            "compute GFLOP/s",
            "t0 ms",
            "links: alpha + bandwidth",
            "Top-k codec / IST round",
            "straggler x",
            "DDP ms/bucket",
            "timing spread",
            "load avg",
        ],
        consts,
    )
    legend = (
        "bytes: summary.json's sent per worker (mean; max = rank 0) against the ledger formulas; "
        "step: rank 0's wall_s / steps; error = predicted / measured - 1; run spread: "
        "interquartile range / median of the run's step times; cal. drift: change of the "
        "compute rate from the calibration before the run to the one after"
    )
    return (
        f"{head}\n(`{data['command']}`)\n\n{table_1}\n\n{legend}\n\nstep-time error: mean {100 * sum(errors) / len(errors):.1f}%, "
        f"max {100 * max(errors):.1f}%; {data['seconds']:.0f} s in all\n\n"
        f"Calibration behind each prediction (the calibrations just before and just after its "
        f"run, interpolated in time to the middle of its training steps)\n\n"
        f"{table_2}\n"
    )
