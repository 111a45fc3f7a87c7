"""Tables from run directories: one row per run, the same columns for every method."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError


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
    """A finished run's summary and records, checked on reading: a missing, unreadable or
    malformed ``summary.json`` or ``metrics.jsonl`` (bad JSON, wrong types, missing fields the
    tables need) is a one-line UsageError naming the file, never a traceback later on.
    Tested by ``tests/reliability/test_report_inputs.py`` and the fuzz tests beside it."""
    p = Path(path)
    if not (p / "summary.json").is_file() or not (p / "metrics.jsonl").is_file():
        raise UsageError(f"{p} is not a finished run directory (no summary.json / metrics.jsonl); "
                         "pass directories written by thinwire train or compare")
    summary = _read_json(p / "summary.json")
    problem = _summary_problem(summary)
    if problem:
        raise UsageError(f"{p / 'summary.json'} is not a thinwire summary ({problem}); "
                         "pass a run directory written by thinwire train or compare, or re-run it")
    records = _read_records(p / "metrics.jsonl")
    if not any(r["kind"] == "eval" for r in records):
        raise UsageError(f"{p / 'metrics.jsonl'} holds no evaluation record (every finished run "
                         f"has one); {_DAMAGED}")
    return Run(p, summary, records)


METRIC_RANGES: dict[str, tuple[float, float, str]] = {
    "accuracy": (0.0, 1.0, "a fraction"), "auc": (0.0, 1.0, "a fraction"),
    "precision@1": (0.0, 1.0, "a fraction"), "perplexity": (1.0, math.inf, "at least 1"),
}
"""A target a metric can reach: (low, high, what the metric is); low excluded for fractions
(every run reaches 0), included for perplexity (1: every token certain)."""


def check_target(target: float | None, metric: str | None = None) -> None:
    """``--target``: None (the best value every run reached) or a finite number that
    ``metric`` (when known) can reach: accuracy, AUC and precision in (0, 1], perplexity >= 1."""
    if target is None:
        return
    if not math.isfinite(target):
        raise UsageError(f"--target {target}: give a finite metric value, e.g. --target 0.9 "
                         "(or leave it out for the best value every run reached)")
    low, high, what = METRIC_RANGES.get(metric or "", (-math.inf, math.inf, ""))
    if not (low < target <= high if high == 1.0 else low <= target <= high):
        fix = "(0, 1], e.g. --target 0.9" if high == 1.0 else f"[{low:g}, {high:g}]"
        raise UsageError(f"--target {target:g}: {metric} is {what}, so this target is never "
                         f"reached; give a value in {fix}")


_DAMAGED = "the file is damaged: re-run the run, or restore the file"


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise UsageError(f"{path} cannot be read ({exc.strerror}); check its permissions") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text; {_DAMAGED}") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except (ValueError, RecursionError) as exc:
        where = f" (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise UsageError(f"{path} is not valid JSON{where}; {_DAMAGED}") from None


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _summary_problem(s: Any) -> str:
    """Why ``s`` cannot feed the tables; '' when it can."""
    if not isinstance(s, dict):
        return f"top level is {type(s).__name__}, not an object"
    need: dict[str, tuple[str, ...]] = {
        "memory": ("params_held_max", "params_full"),
        "bytes": ("sent_per_worker_mean", "sent_per_worker_max"),
    }
    if not _is_num(s.get("wall_s")) or not math.isfinite(s["wall_s"]) or s["wall_s"] < 0:
        return "wall_s is not a number >= 0"
    for key in ("steps", "workers"):
        v = s.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{key} is {v!r}, not a positive integer"
    for section, keys in need.items():
        sec = s.get(section)
        if not isinstance(sec, dict):
            return f"{section} is not an object"
        for k in keys:
            if not _is_num(sec.get(k)):
                return f"{section}.{k} is not a number"
    if not s["memory"]["params_full"]:
        return "memory.params_full is 0"
    final = s.get("final", {})
    if not isinstance(final, dict) or any(not _is_num(final[k]) for k in ("accuracy", "nll")
                                          if k in final):
        return "final is not an object of numbers"
    if "config" in s and not (isinstance(s["config"], dict)
                              and all(isinstance(v, dict) for v in s["config"].values())):
        return "config is not an object of sections"
    if "config" not in s and not isinstance(s.get("label", ""), str):
        return "label is not a string"
    return ""


_RECORD_FIELDS = {"train": ("step", "loss"), "eval": ("step", "accuracy", "nll", "wall_s",
                                                     "sent_bytes")}


def _read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except (ValueError, RecursionError):
            raise UsageError(f"{path} line {n} is not valid JSON; {_DAMAGED}") from None
        if not isinstance(r, dict) or not isinstance(r.get("kind"), str):
            raise UsageError(f"{path} line {n} is not a metrics record (no kind); {_DAMAGED}")
        for k in _RECORD_FIELDS.get(r["kind"], ()):
            if not _is_num(r.get(k)):
                raise UsageError(f"{path} line {n}: {r['kind']} record lacks a numeric {k}; "
                                 f"{_DAMAGED}")
        records.append(r)
    return records


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
BESIDE = {"precision@1": ("precision@5",)}
"""Metrics printed beside a task's metric in the summary table."""


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
    beside = BESIDE.get(metric, ())
    head = (f"| method | {METRIC_HEADS.get(metric, metric)} | "
            + "".join(f"{b} | " for b in beside)
            + "test NLL | sent/worker (max) | params trained/worker | wall s |")
    lines = [head, "|---|---:|" + "---:|" * len(beside) + "---:|---:|---:|---:|"]
    for s in summaries:
        f = s.get("final", {})
        m = s["memory"]
        lines.append(f"| {s['label']} | {f.get(metric, float('nan')):.4f} | "
                     + "".join(f"{f.get(b, float('nan')):.4f} | " for b in beside)
                     + f"{f.get('nll', float('nan')):.4f} | {fmt_bytes(s['bytes']['sent_per_worker_max'])} | "
                     f"{fmt_count(m['params_held_max'])} ({m['params_held_max'] / m['params_full']:.1%}) | "
                     f"{s['wall_s']:.1f} |")
    return "\n".join(lines)


def memory_table(runs: list[Run]) -> str:
    """Measured memory per rank (the most loaded rank of each figure): parameters, gradients,
    optimizer state, activations saved for backward, parameters gathered by a sharded model,
    their sum when the backward pass starts, the process's peak resident set and, on CUDA, the
    allocator's peak. Runs written before these were measured show '-'."""
    head = ("| method | memory options | params | grads | optimizer | activations | gathered "
            "| peak (sum) | process RSS peak | device peak |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(m: dict[str, Any], key: str) -> str:
        v: Any = m.get(key)
        if not _is_num(v) or (key == "device_peak_bytes_max" and not v):
            return "-"
        return fmt_bytes(float(v))

    for run in runs:
        m = run.summary["memory"]
        o = m.get("options")
        o = o if isinstance(o, dict) else {}
        opts = (f"zero={o.get('zero', 0)} recompute={o.get('recompute', 'none')} "
                f"offload={o.get('offload', 'none')}") if o else "-"
        keys = ("params_bytes_max", "grads_bytes_max", "optimizer_bytes_max",
                "activations_bytes_max", "gathered_bytes_max", "peak_bytes_max",
                "rss_peak_bytes_max", "device_peak_bytes_max")
        lines.append(f"| {run.summary['label']} | {opts} | "
                     + " | ".join(cell(m, k) for k in keys) + " |")
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
