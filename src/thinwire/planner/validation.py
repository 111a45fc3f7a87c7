"""Validation: the planner's predictions beside published measurements (``--validate``).

Three checks, all printed by ``thinwire plan --validate`` (docs/PLANNER.md shows its output):
1. memory, Korthikanti et al. 2022 Fig. 1 (22B and 175B) and the ZeRO paper's example;
2. step time, Korthikanti et al. 2022 Table 5 (iteration seconds, 8 runs) and Narayanan et al.
   2021 Table 1 (achieved TFLOP/s per GPU, 10 runs), on the a100-80gb preset;
3. the one calibrated constant, ``compute_efficiency``: fit by least squares on log(predicted /
   measured) over all 18 runs, reported with leave-one-out errors (each run predicted by a fit
   that never saw it) and held out across papers (:func:`held_out`: fit on Narayanan et al.'s
   runs, test on Korthikanti et al.'s, and the reverse, beside the in-sample error of a fit on
   the tested paper itself).
Error = (predicted - measured) / measured of the reported metric.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from thinwire.planner.memory import (
    GIB,
    ParamBytes,
    memory_breakdown,
    transformer_params_per_device,
    zero_model_states,
)
from thinwire.planner.presets import load_cluster
from thinwire.planner.published import (
    PublishedRun,
    korthikanti_memory,
    korthikanti_times,
    narayanan_table1,
)
from thinwire.planner.render import pct, table
from thinwire.planner.specs import ClusterSpec
from thinwire.planner.step import predict

ZERO_EXAMPLE = (120.0, 31.4, 16.6, 1.9)  # GB, Rajbhandari et al. 2020, Psi = 7.5B, N_d = 64


def all_runs() -> list[PublishedRun]:
    return korthikanti_times() + narayanan_table1()


def predicted_metric(run: PublishedRun, cluster: ClusterSpec) -> float:
    """The run's metric as the planner predicts it on ``cluster`` (nodes set from the run)."""
    nodes = max(1, math.ceil(run.strategy.devices / cluster.devices_per_node))
    pred = predict(run.model, dataclasses.replace(cluster, nodes=nodes), run.strategy)
    if run.metric == "iteration_s":
        return pred.step_time
    flops = run.model.flops_per_step(run.strategy.global_batch(), "full")  # Narayanan Eq. 3
    return flops / (pred.step_time * run.strategy.devices) / 1e12


def _log_error(run: PublishedRun, cluster: ClusterSpec) -> float:
    ratio = predicted_metric(run, cluster) / run.measured
    return math.log(ratio) if run.metric == "iteration_s" else -math.log(ratio)


def fit_compute_efficiency(runs: Sequence[PublishedRun], cluster: ClusterSpec) -> float:
    """argmin over f in [0.3, 1] of sum log^2(predicted time / measured time) (golden section)."""

    def loss(f: float) -> float:
        c = dataclasses.replace(cluster, compute_efficiency=f)
        return sum(_log_error(r, c) ** 2 for r in runs)

    lo, hi = 0.3, 1.0
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(30):  # bracket shrinks to 0.7 * 0.618^30 ~ 4e-7
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(b)
    return (lo + hi) / 2


def error(run: PublishedRun, cluster: ClusterSpec) -> float:
    return predicted_metric(run, cluster) / run.measured - 1.0


@dataclass(frozen=True)
class StepCheck:
    """One published run beside its prediction (errors are fractions, signed)."""

    source: str
    run: str
    metric: str
    measured: float
    predicted: float
    """With the fit on all runs."""
    error_uncalibrated: float
    error_calibrated: float
    error_leave_one_out: float


@dataclass(frozen=True)
class HeldOut:
    """``compute_efficiency`` fit on one paper's runs, tested on another's (errors: |fraction|)."""

    test_on: str
    fit_on: str
    efficiency: float
    """The fit on ``fit_on``'s runs."""
    in_sample_mean: float
    """Mean |error| on ``test_on``'s runs with a fit on those same runs."""
    in_sample_max: float
    held_out_mean: float
    """Mean |error| on ``test_on``'s runs with the fit on ``fit_on``'s."""
    held_out_max: float


def _with(cluster: ClusterSpec, efficiency: float) -> ClusterSpec:
    return dataclasses.replace(cluster, compute_efficiency=efficiency)


def _abs_errors(runs: Sequence[PublishedRun], cluster: ClusterSpec) -> list[float]:
    return [abs(error(r, cluster)) for r in runs]


def held_out(cluster: ClusterSpec) -> list[HeldOut]:
    """1. fit on each paper's runs; 2. test each paper with its own fit (in sample) and with
    the other paper's (held out): Korthikanti et al. 2022 Table 5 and Narayanan et al. 2021
    Table 1."""
    raw = _with(cluster, 1.0)
    papers = {"Korthikanti 2022 T5": korthikanti_times(), "Narayanan 2021 T1": narayanan_table1()}
    fits = {name: fit_compute_efficiency(runs, raw) for name, runs in papers.items()}
    out = []
    for (test, runs), other in zip(papers.items(), reversed(list(papers))):
        own = _abs_errors(runs, _with(raw, fits[test]))
        held = _abs_errors(runs, _with(raw, fits[other]))
        out.append(HeldOut(test, other, fits[other], sum(own) / len(own), max(own),
                           sum(held) / len(held), max(held)))
    return out


def _fits_and_errors(runs: list[PublishedRun], raw: ClusterSpec
                     ) -> tuple[float, list[StepCheck], dict[str, list[float]]]:
    """The fit on all runs; per run its errors uncalibrated, calibrated and leave-one-out."""
    f_all = fit_compute_efficiency(runs, raw)
    fitted = _with(raw, f_all)
    records: list[StepCheck] = []
    errs: dict[str, list[float]] = {"raw": [], "cal": [], "loo": []}
    for i, run in enumerate(runs):
        loo = _with(raw, fit_compute_efficiency(runs[:i] + runs[i + 1 :], raw))
        e = {"raw": error(run, raw), "cal": error(run, fitted), "loo": error(run, loo)}
        for key, val in e.items():
            errs[key].append(abs(val))
        records.append(StepCheck(run.source, run.label, run.metric, run.measured,
                                 predicted_metric(run, fitted), e["raw"], e["cal"], e["loo"]))
    return f_all, records, errs


def step_time_records(cluster: ClusterSpec) -> tuple[list[StepCheck], dict[str, float]]:
    """One record per published run (measured, predicted, errors uncalibrated / calibrated /
    leave-one-out) and a summary: the fits, mean / max absolute errors, and per tested paper
    (``korthikanti``, ``narayanan``) the in-sample and held-out errors of :func:`held_out`
    (``heldout_korthikanti_mean``: Korthikanti's runs predicted with the fit on Narayanan's)."""
    raw = _with(cluster, 1.0)
    f_all, records, errs = _fits_and_errors(all_runs(), raw)
    summary = {"fit_all": f_all, "preset": cluster.compute_efficiency}
    summary |= {f"mean_{k}": sum(v) / len(v) for k, v in errs.items()}
    summary |= {f"max_{k}": max(v) for k, v in errs.items()}
    for h in held_out(cluster):
        paper = h.test_on.split()[0].lower()
        summary[f"fit_{h.fit_on.split()[0].lower()}"] = h.efficiency
        summary |= {f"insample_{paper}_mean": h.in_sample_mean,
                    f"insample_{paper}_max": h.in_sample_max,
                    f"heldout_{paper}_mean": h.held_out_mean,
                    f"heldout_{paper}_max": h.held_out_max}
    return records, summary


def _step_rows(records: list[StepCheck]) -> list[list[object]]:
    """The step-time table's rows."""
    rows: list[list[object]] = []
    for r in records:
        unit = "s" if r.metric == "iteration_s" else "TFLOP/s"
        rows.append(
            [
                f"{r.source} {r.run}",
                f"{r.measured:g} {unit}",
                f"{r.predicted:.4g}",
                pct(r.error_uncalibrated),
                pct(r.error_calibrated),
                pct(r.error_leave_one_out),
            ]
        )
    return rows


def memory_table(cluster: ClusterSpec) -> list[list[object]]:
    """Korthikanti Fig. 1: model states (18 B/param, layers only) and activations, GiB."""
    rows: list[list[object]] = []
    for point in korthikanti_memory():
        states = (
            transformer_params_per_device(point.model, point.strategy, embeddings=False) * 18 / GIB
        )
        acts = memory_breakdown(point.model, cluster, point.strategy).activations / GIB
        rows.append(
            [
                point.label,
                f"{point.model_states_gib:.2f}",
                f"{states:.2f}",
                pct(states / point.model_states_gib - 1, 2),
                f"{point.activations_gib:.2f}",
                f"{acts:.2f}",
                pct(acts / point.activations_gib - 1, 2),
            ]
        )
    return rows


def zero_table() -> list[list[object]]:
    """ZeRO paper example: Psi = 7.5B, N_d = 64, 2 + 2 + K (K = 12) bytes per parameter."""
    rows: list[list[object]] = []
    for stage, published in enumerate(ZERO_EXAMPLE):
        got = sum(zero_model_states(7.5e9, 64, stage, ParamBytes(2.0, 2.0, 12.0))) / 1e9
        rows.append(
            [f"ZeRO stage {stage}", f"{published:g}", f"{got:.3g}", pct(got / published - 1, 2)]
        )
    return rows


def held_out_table(cluster: ClusterSpec) -> str:
    """The held-out check as a table (:func:`held_out`)."""
    rows = [[h.test_on, h.fit_on, f"{h.efficiency:.3f}",
             f"{100 * h.in_sample_mean:.2f}% (max {100 * h.in_sample_max:.2f}%)",
             f"{100 * h.held_out_mean:.2f}% (max {100 * h.held_out_max:.2f}%)"]
            for h in held_out(cluster)]
    return table(
        ["runs tested", "fit on", "compute_eff.", "in sample |err|", "held out |err|"],
        rows,
        "Held out across papers: compute_efficiency fit on one paper's runs, tested on the other's",
    )


@dataclass(frozen=True)
class SamePlan:
    """One configuration both papers measured: the same model dimensions and, per pipeline,
    the same t, p, b, m, v and recomputation (only d differs)."""

    label: str
    seconds: tuple[float, float]
    """Measured iteration seconds (Korthikanti's; Narayanan's from TFLOP/s by Eq. 3)."""
    predicted: tuple[float, float]
    """The planner's iteration seconds (the preset's compute_efficiency)."""


def _same(a: PublishedRun, b: PublishedRun) -> bool:
    dims = ("layers", "hidden", "heads", "seq", "vocab")
    keys = ("tp", "pp", "micro_batch_size", "micro_batches", "interleave", "recompute")
    return (all(getattr(a.model, k) == getattr(b.model, k) for k in dims)
            and all(getattr(a.strategy, k) == getattr(b.strategy, k) for k in keys))


def seconds_of(run: PublishedRun, metric_value: float) -> float:
    """Iteration seconds of a run's metric value (TFLOP/s per GPU by Narayanan's Eq. 3)."""
    if run.metric == "iteration_s":
        return metric_value
    flops = run.model.flops_per_step(run.strategy.global_batch(), "full")
    return flops / (metric_value * 1e12 * run.strategy.devices)


def same_plans(cluster: ClusterSpec) -> list[SamePlan]:
    """Configurations measured in both papers: what a held-out fit across papers is up
    against (any prediction from the configuration gives both the same time but for d)."""
    out = []
    for a in korthikanti_times():
        for b in narayanan_table1():
            if _same(a, b):
                out.append(SamePlan(
                    f"{a.label} (d=1) / {b.label} (d={b.strategy.dp})",
                    (a.measured, seconds_of(b, b.measured)),
                    (predicted_metric(a, cluster), seconds_of(b, predicted_metric(b, cluster)))))
    return out


def same_plans_table(cluster: ClusterSpec) -> str:
    rows = [[p.label, f"{p.seconds[0]:.2f}", f"{p.seconds[1]:.2f}",
             pct(p.seconds[1] / p.seconds[0] - 1), pct(p.predicted[1] / p.predicted[0] - 1)]
            for p in same_plans(cluster)]
    return table(["same configuration (t, p, b, m, v, recompute)", "Korthikanti s",
                  "Narayanan s", "measured diff.", "predicted diff."], rows,
                 "Measured in both papers: Narayanan's seconds from its TFLOP/s (Eq. 3); only "
                 "the data-parallel degree d differs")


def _notes(sm: dict[str, float]) -> str:
    """The fit and the mean / max errors under the step-time table."""
    return "\n".join([
        f"compute_efficiency: fit on all 18 runs {sm['fit_all']:.3f} (preset uses "
        f"{sm['preset']:.3f})",
        f"mean |error|: uncalibrated {100 * sm['mean_raw']:.2f}% (max {100 * sm['max_raw']:.2f}%), "
        f"calibrated {100 * sm['mean_cal']:.2f}% (max {100 * sm['max_cal']:.2f}%), "
        f"leave-one-out {100 * sm['mean_loo']:.2f}% (max {100 * sm['max_loo']:.2f}%)",
    ])


def render_validation(cluster: ClusterSpec | None = None) -> str:
    """The text ``thinwire plan --validate`` prints."""
    cluster = cluster or load_cluster("a100-80gb")
    mem = table(
        ["configuration", "states pub", "pred", "err", "activ. pub", "pred", "err"],
        memory_table(cluster),
        "Memory per GPU, GiB: Korthikanti et al. 2022 Fig. 1 (A100-80GB)",
    )
    zero = table(
        ["model states", "paper GB", "pred GB", "err"],
        zero_table(),
        "Model states per GPU: Rajbhandari et al. 2020 (Psi = 7.5B, N_d = 64)",
    )
    records, sm = step_time_records(cluster)
    steps = table(
        ["run", "measured", "predicted", "err uncal.", "err cal.", "err LOO"],
        _step_rows(records),
        "Step time on a100-80gb: iteration seconds (Korthikanti) / TFLOP/s per GPU (Narayanan)",
    )
    return "\n\n".join([mem, zero, steps, _notes(sm), held_out_table(cluster),
                        same_plans_table(cluster)]) + "\n"
