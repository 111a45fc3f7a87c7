"""A small valid run directory for the report (hand-made: no training needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def summary() -> dict[str, Any]:
    return {"method": "dp", "label": "dp", "run": "dp", "workers": 2, "steps": 20,
            "final": {"accuracy": 0.8, "nll": 0.6}, "wall_s": 1.0, "compute_s": 0.5,
            "comm_s": 0.5,
            "bytes": {"sent_per_worker_mean": 1e6, "sent_per_worker_max": 1.2e6,
                      "payload_per_worker_mean": 1e6, "recv_per_worker_max": 1e6,
                      "per_rank_sent": [1e6, 1.2e6], "collectives_estimated": True},
            "memory": {"params_bytes_max": 400, "grads_bytes_max": 400, "optimizer_bytes_max": 0,
                       "params_held_max": 100, "params_stored_max": 100, "params_full": 100}}


def records() -> list[dict[str, Any]]:
    return [{"kind": "train", "step": 10, "loss": 1.0, "lr": 0.1, "wall_s": 0.5,
             "sent_bytes": 5e5},
            {"kind": "eval", "step": 20, "accuracy": 0.8, "nll": 0.6, "wall_s": 1.0,
             "sent_bytes": 1e6, "sent_bytes_max": 1.2e6, "payload_bytes": 1e6}]


def write_report_run(run: Path) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "summary.json").write_text(json.dumps(summary()))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    return run
