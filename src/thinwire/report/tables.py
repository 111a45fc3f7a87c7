"""Tables from run directories: one row per run, the same columns for every method."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.metrics import read_jsonl


@dataclass(frozen=True)
class Run:
    path: Path
    summary: dict[str, Any]
    records: list[dict[str, Any]]

    @property
    def evals(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == "eval"]

    @property
    def trains(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == "train"]

    @property
    def label(self) -> str:
        """The method's label, as the run recorded it."""
        return str(self.summary.get("label", self.path.name))

    @property
    def metric(self) -> str:
        """The task's metric (``accuracy``, ``perplexity``)."""
        return str(self.summary.get("metric", "accuracy"))

    @property
    def higher_is_better(self) -> bool:
        return bool(self.summary.get("higher_is_better", True))

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target


def load_run(path: str | Path) -> Run:
    p = Path(path)
    if not (p / "summary.json").is_file() or not (p / "metrics.jsonl").is_file():
        raise UsageError(f"{p} is not a finished run directory (no summary.json / metrics.jsonl); "
                         "pass directories written by thinwire train or compare")
    return Run(p, json.loads((p / "summary.json").read_text()), read_jsonl(p / "metrics.jsonl"))


def time_to_target(run: Run, target: float) -> dict[str, Any] | None:
    """The first evaluation whose metric reaches ``target`` (at or above accuracy, at or below
    perplexity): its step, wall time and bytes."""
    for r in run.evals:
        if run.reached(r[run.metric], target):
            return {"step": r["step"], "wall_s": r["wall_s"], "sent_bytes": r["sent_bytes"]}
    return None


def common_target(runs: list[Run]) -> float:
    """The best metric value every run reached (so every run has a time to it)."""
    if not runs:
        return 0.0
    pick = max if runs[0].higher_is_better else min
    best = [pick((r[run.metric] for r in run.evals), default=0.0) for run in runs]
    return min(best) if runs[0].higher_is_better else max(best)


METRIC_HEADS = {"accuracy": "test acc", "perplexity": "val ppl"}


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(b) < 1000 or unit == "TB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1000
    raise AssertionError


def fmt_count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def summary_table(summaries: list[dict[str, Any]]) -> str:
    """A short table straight from summary.json files (no target column)."""
    metric = summaries[0].get("metric", "accuracy") if summaries else "accuracy"
    head = (f"| method | {METRIC_HEADS.get(metric, metric)} | test NLL | sent/worker (max) "
            "| params trained/worker | wall s |")
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for s in summaries:
        f = s.get("final", {})
        m = s["memory"]
        lines.append(f"| {s['label']} | {f.get(metric, float('nan')):.4f} | "
                     f"{f.get('nll', float('nan')):.4f} | {fmt_bytes(s['bytes']['sent_per_worker_max'])} | "
                     f"{fmt_count(m['params_held_max'])} ({m['params_held_max'] / m['params_full']:.1%}) | "
                     f"{s['wall_s']:.1f} |")
    return "\n".join(lines)


def compare_table(runs: list[Run], target: float | None = None) -> str:
    """The comparison table: accuracy, NLL, bytes, parameters held, wall time, time to target."""
    tgt = common_target(runs) if target is None else target
    metric = runs[0].metric if runs else "accuracy"
    head = (f"| method | {METRIC_HEADS.get(metric, metric)} | test NLL | sent/worker mean "
            "| sent/worker max | params trained/worker "
            f"| wall s | steps to {tgt:.3f} | s to {tgt:.3f} | sent/worker to {tgt:.3f} |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        s = run.summary
        f, m, b = s.get("final", {}), s["memory"], s["bytes"]
        hit = time_to_target(run, tgt)
        ttt = (f"{hit['step']} | {hit['wall_s']:.1f} | {fmt_bytes(hit['sent_bytes'])}" if hit
               else "not reached | - | -")
        lines.append(
            f"| {run.label} | {f.get(metric, float('nan')):.4f} | {f.get('nll', float('nan')):.4f} "
            f"| {fmt_bytes(b['sent_per_worker_mean'])} | {fmt_bytes(b['sent_per_worker_max'])} "
            f"| {fmt_count(m['params_held_max'])} ({m['params_held_max'] / m['params_full']:.1%}) "
            f"| {s['wall_s']:.1f} | {ttt} |")
    est = any(r.summary["bytes"].get("collectives_estimated") for r in runs)
    note = ("\nBytes: per worker, from the ledger; collective traffic is the estimated wire bytes "
            "of the ring algorithm, point-to-point traffic is exact." if est else
            "\nBytes: per worker, exact point-to-point payloads from the ledger.")
    return "\n".join(lines) + note
