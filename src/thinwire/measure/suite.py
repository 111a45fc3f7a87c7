"""The calibration suite: calibrate, run, calibrate again; predicted against measured.

``thinwire plan --calibrate`` trains one run of every registered method at its own defaults
(the ones ``thinwire train`` uses) and one of data parallelism with Top-k (1%, error feedback)
on an MLP here, through the library's run layer (:func:`thinwire.run.run_config`, the launcher
of ``thinwire train``), and compares each run's ``summary.json`` with the run predictor
(:mod:`thinwire.measure.predict`). Steps of :func:`run_suite`:

1. the run configs (:func:`suite_configs`), each run's layout and bytes, and each run's shape on a
   silent communicator (:func:`~thinwire.measure.local.run_shape`);
2. the measurements those runs need (:func:`probe_for`), then one calibration;
3. per run: train it, calibrate again, and predict it from the two calibrations around it
   interpolated to the middle of its steps (:func:`~thinwire.measure.calibrate.bracket`);
4. the table of predicted against measured (:func:`calibration_report`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from thinwire.errors import UsageError
from thinwire.measure.calibrate import (
    Calibration,
    Probe,
    bracket,
    calibrate,
    preimport,
    spread_of,
)
from thinwire.measure.local import RunShape, run_shape
from thinwire.measure.predict import predict_run, run_layout, run_traffic

if TYPE_CHECKING:
    from thinwire.config import Config
    from thinwire.data import Dataset
    from thinwire.strategies.traffic import Layout, Traffic

CODEC_RUN = "topk:ratio=0.01"
"""The compressed run of the suite, beside every method at its defaults."""
DATA = {784: "fashion-mnist", 64: "digits"}
"""Input width -> the dataset the suite trains on."""


def suite_specs() -> list[str]:
    """Every registered method priced from a model's layout alone (its defaults; ``planned``),
    and :data:`CODEC_RUN`."""
    from thinwire.strategies import METHODS

    return [name for name, e in METHODS.entries() if e.planned] + [CODEC_RUN]


def suite_configs(widths: Sequence[int], workers: int, steps: int, batch: int, out: str,
          extra: dict[str, str] | None = None) -> list[Config]:
    """The run configs of the suite for one MLP (input 784: Fashion-MNIST, 64: digits)."""
    from thinwire import config as config_mod
    from thinwire.run import method_overrides, run_name

    if widths[0] not in DATA or widths[-1] != 10:
        raise UsageError(
            f"--calibrate trains mlp-784-...-10 (Fashion-MNIST) or mlp-64-...-10 "
            f"(digits), not mlp-{'-'.join(map(str, widths))}"
        )
    base = {
        "data.name": DATA[widths[0]], "model.hidden": ",".join(map(str, widths[1:-1])),
        "train.batch_size": str(batch), "train.steps": str(steps), "train.eval_every": "0",
        "train.log_every": "1", "runtime.workers": str(workers), "run.out": out,
        "run.progress": "false", **(extra or {}),
    }
    return [config_mod.load(None, {**base, **method_overrides(spec), "run.name": run_name(spec)})
            for spec in suite_specs()]


def _call_sizes(t: Traffic, n: int) -> dict[str, set[int]]:
    """Bytes per call of each of rank 0's ops (a rank's payload; a fan-out's one message)."""
    out: dict[str, set[int]] = {}
    for op, (calls, wire) in t.rank0_calls.items():
        if not calls or n < 2:
            continue
        share = {"all_reduce": n / (2 * (n - 1))}.get(op, 1 / (n - 1))
        out.setdefault(op, set()).add(4 * max(1, round(wire * share / calls / 4)))
    return out


def _models(widths: Sequence[int], shapes: Sequence[RunShape]) -> list[tuple[int, ...]]:
    """The full model, every run's trained model, and a half-width one when they are all one."""
    models = list(dict.fromkeys([tuple(widths), *(s.key for s in shapes)]))
    if len(models) == 1:
        models.append((widths[0], *(max(1, h // 2) for h in widths[1:-1]), widths[-1]))
    return models


def probe_for(configs: Sequence[Config], widths: Sequence[int], shapes: Sequence[RunShape],
              layout: Layout, traffics: Sequence[Traffic], reps: int = 5) -> Probe:
    """The measurements the runs of ``configs`` (all of one MLP ``widths``) need."""
    from thinwire.strategies.data_parallel import buckets

    cfg, n = configs[0], configs[0].runtime.workers
    models = _models(widths, shapes)
    ddp = tuple(sum(p.numel for p in b) for b in buckets(layout.ready_order))
    sizes: dict[str, set[int]] = {"all_reduce": {1 << 12, 1 << 16, 1 << 20, 4 * layout.numel,
                                                 *(4 * b for b in ddp)}}
    for t in traffics:
        for op, found in _call_sizes(t, n).items():
            sizes.setdefault(op, {1 << 12, 1 << 16, 1 << 20}).update(found)
    sizes["p2p"] = sizes.get("p2p", set()) | {2 * s for s in sizes.get("p2p", set())}
    codecs = {s.codec: (layout.numel, layout.numel // 4) for s in shapes if s.codec != "none"}
    return Probe(
        models=tuple(models), batch=cfg.train.batch_size, norm=cfg.model.options.norm,
        threads=cfg.runtime.threads or max(1, (os.cpu_count() or 1) // n),
        all_reduce=tuple(sorted(sizes["all_reduce"])),
        all_gather=tuple(sorted(sizes.get("all_gather", ()))),
        p2p=tuple(sorted(sizes["p2p"])), codecs=tuple(codecs.items()),
        syncs=tuple(sorted({(models.index(s.key), s.sync_every) for s in shapes})),
        ddp=ddp, runs=tuple(c for c in configs if c.sync_every > 2), reps=reps)


def measured(summary: dict[str, Any], run_dir: str) -> dict[str, float]:
    """What a run measured: step time = wall_s / steps (rank 0, training steps only), the
    summary's bytes, and the spread (IQR / median) of its per-step times in metrics.jsonl."""
    import json
    from pathlib import Path


    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    steps = [rec["step_s"] for line in lines if (rec := json.loads(line)).get("kind") == "train"]
    b = summary["bytes"]
    return {
        "step_time_s": summary["wall_s"] / summary["steps"],
        "sent_per_worker_mean": b["sent_per_worker_mean"],
        "sent_per_worker_max": b["sent_per_worker_max"],
        "payload_per_worker_mean": b["payload_per_worker_mean"],
        "spread": spread_of(steps) if steps else 0.0,
    }


def _prepare(configs: list[Config], widths: Sequence[int], ds: Dataset, reps: int
             ) -> tuple[Probe, Layout, list[RunShape]]:
    """Step 1-2's inputs: the layout (one model for all runs), shapes and the probe."""
    layout = run_layout(configs[0], ds)
    shapes = [run_shape(cfg, ds) for cfg in configs]
    traffics = [run_traffic(cfg, layout) for cfg in configs]
    probe = probe_for(configs, widths, shapes, layout, traffics, reps=reps)
    return replace(probe, data=ds), layout, shapes


def _one_run(cfg: Config, probe: Probe, before: Calibration, layout: Layout, shape: RunShape
             ) -> tuple[dict[str, Any], Calibration]:
    """Step 3 for one run: train, calibrate again, predict from the bracketing calibrations."""
    from thinwire.run import run_config

    summary = run_config(cfg)
    after = calibrate(probe, cfg.runtime.workers)
    t_end = (cfg.run_dir / "summary.json").stat().st_mtime  # written after the last step
    cal = bracket(before, after, t_end - summary["wall_s"] / 2)
    result = {
        "run": cfg.run_name,
        "predicted": predict_run(cfg, layout, cal, shape),
        "measured": measured(summary, str(cfg.run_dir)),
        "drift": after.compute_flops_per_s / before.compute_flops_per_s - 1,
        "calibration": asdict(cal),
    }
    return result, after


def run_suite(widths: Sequence[int], workers: int, steps: int, batch: int, out: str, *,
              reps: int = 5, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Steps 1-3 (module docstring); the runs' predictions and measurements as plain data."""
    from thinwire.builders import load_data

    start = time.perf_counter()
    configs = suite_configs(widths, workers, steps, batch, out)
    preimport()
    ds = load_data(configs[0])
    probe, layout, shapes = _prepare(configs, widths, ds, reps)
    log("calibrating")
    cal = calibrate(probe, workers)
    results = []
    for cfg, shape in zip(configs, shapes):
        log(f"running {cfg.run_name}, then calibrating")
        result, cal = _one_run(cfg, probe, cal, layout, shape)
        results.append(result)
    return {"widths": list(widths), "workers": workers, "steps": steps, "batch_size": batch,
            "cores": os.cpu_count(), "seconds": time.perf_counter() - start, "runs": results}


# --- step 4: the report --------------------------------------------------------------------------
_BYTES = ("sent_per_worker_mean", "sent_per_worker_max", "payload_per_worker_mean")


def _md(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table, numbers right-aligned."""
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join(["---"] + ["--:"] * (len(headers) - 1)) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _result_row(r: dict[str, Any]) -> list[object]:
    """A run's bytes and step time, predicted and measured."""
    p, m = r["predicted"], r["measured"]
    parts = ("compute_time_s", "comm_time_s", "codec_time_s", "sync_time_s")
    return [
        r["run"], f"{p['sent_per_worker_mean']:,.0f}", f"{m['sent_per_worker_mean']:,.0f}",
        f"{p['sent_per_worker_max']:,.0f}", f"{m['sent_per_worker_max']:,.0f}",
        "exact" if all(p[k] == m[k] for k in _BYTES) else "DIFFERENT",
        f"{1e3 * p['step_time_s']:.1f}", f"{1e3 * m['step_time_s']:.1f}",
        f"{100 * (p['step_time_s'] / m['step_time_s'] - 1):+.1f}%",
        " / ".join(f"{1e3 * p[k]:.1f}" for k in parts),
        f"{100 * m['spread']:.0f}%", f"{100 * r['drift']:+.0f}%",
    ]


def _links(c: dict[str, Any]) -> str:
    return ", ".join(
        f"{k} {1e6 * f['alpha_s']:.0f} us + "
        + (f"{f['bytes_per_s'] / 1e6:,.0f} MB/s" if f["bytes_per_s"] < 1e13 else "inf")
        for k, f in c["links"].items()
    )


def _constants_row(r: dict[str, Any]) -> list[object]:
    """The calibrated constants behind a run's prediction."""
    c = r["calibration"]
    codecs = ", ".join(f"{rate / 1e6:,.0f} MB/s" for rate in c["codecs"].values())
    local = c["sync_overhead_s"].get(r["run"], 0.0)
    return [
        r["run"], f"{c['compute_flops_per_s'] / 1e9:.2f}", f"{1e3 * c['step_overhead_s']:.2f}",
        _links(c), codecs or "-", f"{1e3 * local:.1f}" if local else "-",
        f"{r['predicted']['straggler']:.2f}", f"{1e3 * c['call_overhead_s']:.1f}",
        f"{100 * c['spread']:.0f}%", f"{c['load_average']:.1f}",
    ]


_RESULT_HEAD = ("run", "sent B/worker pred", "measured", "rank 0 sent pred", "measured", "bytes",
                "step ms pred", "measured", "error", "pred compute / comm / codec / sync ms",
                "run spread", "cal. drift")
_CONSTANTS_HEAD = ("run", "compute GFLOP/s", "t0 ms", "links: alpha + bandwidth", "codecs",
                   "sync work ms/period", "straggler x", "DDP ms/bucket", "timing spread",
                   "load avg")
LEGEND = (
    "bytes: summary.json's sent per worker (mean; max = rank 0) against the methods' traffic "
    "functions; step: rank 0's wall_s / steps; error = predicted / measured - 1; run spread: "
    "interquartile range / median of the run's step times; cal. drift: change of the compute "
    "rate from the calibration before the run to the one after"
)


def calibration_report(data: dict[str, Any]) -> str:
    """The predicted-against-measured table and the constants behind each prediction."""
    runs = data["runs"]
    errors = [abs(r["predicted"]["step_time_s"] / r["measured"]["step_time_s"] - 1) for r in runs]
    head = (f"Predicted against measured: mlp-{'-'.join(map(str, data['widths']))}, "
            f"{data['workers']} workers on {data['cores']} cores, batch {data['batch_size']} "
            f"per worker, {data['steps']} steps")
    summary = (f"step-time error: mean {100 * sum(errors) / len(errors):.1f}%, "
               f"max {100 * max(errors):.1f}%; {data['seconds']:.0f} s in all")
    return "\n\n".join([
        f"{head}\n(`{data['command']}`)" if "command" in data else head,
        _md(_RESULT_HEAD, [_result_row(r) for r in runs]), LEGEND, summary,
        "Calibration behind each prediction (the calibrations just before and just after its "
        "run, interpolated in time to the middle of its training steps)",
        _md(_CONSTANTS_HEAD, [_constants_row(r) for r in runs]),
    ]) + "\n"
