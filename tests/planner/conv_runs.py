"""Hand-built run directories (summary.json + metrics.jsonl) with known crossing steps."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def write_run(path: Path, method: dict[str, object], curve: Sequence[tuple[int, float]],
              metric: str = "accuracy", model: dict[str, object] | None = None,
              data: str = "fashion-mnist", workers: int = 4, batch: int = 128) -> Path:
    """A finished run of ``method`` whose evaluations are ``curve`` [(step, metric value)]."""
    path.mkdir(parents=True, exist_ok=True)
    higher = metric == "accuracy"
    steps = curve[-1][0]
    summary = {
        "method": method["name"], "label": str(method["name"]), "metric": metric,
        "higher_is_better": higher, "workers": workers, "steps": steps,
        "final": {metric: curve[-1][1], "nll": 1.0}, "wall_s": 1.0, "compute_s": 1.0,
        "bytes": {"sent_per_worker_mean": 1.0, "sent_per_worker_max": 1.0},
        "memory": {"params_held_max": 10, "params_full": 10},
        "config": {"method": dict(method), "model": model or {"name": "mlp",
                                                               "hidden": [1024, 1024]},
                   "data": {"name": data}, "train": {"batch_size": batch},
                   "runtime": {"workers": workers}},
    }
    (path / "summary.json").write_text(json.dumps(summary))
    lines = [json.dumps({"kind": "train", "step": s, "loss": 1.0}) for s, _ in curve]
    lines += [json.dumps({"kind": "eval", "step": s, metric: v, "nll": 1.0, "wall_s": float(s),
                          "sent_bytes": 1.0}) for s, v in curve]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def ramp(reach: dict[float, int], steps: int, every: int = 10, start: float = 0.5
         ) -> list[tuple[int, float]]:
    """An evaluation curve first at or above each target of ``reach`` at exactly that step
    (targets ascending, steps ascending), flat below the next target afterwards."""
    points = []
    for s in range(every, steps + 1, every):
        passed = [t for t, at in reach.items() if at <= s]
        value = max(passed) if passed else start
        points.append((s, value))
    return points
