"""Metrics: per-step JSONL records (one schema for every strategy) and evaluation.

``metrics.jsonl`` in the run directory holds records of two kinds, written by rank 0:
- ``{"kind": "train", "step", "loss", "lr", "step_s", "compute_s", "comm_s", "wall_s",
  "sent_bytes", "payload_bytes"}`` every ``train.log_every`` steps (rank 0's counters, cumulative);
- ``{"kind": "eval", "step", "accuracy", "nll", "wall_s", "sent_bytes", "sent_bytes_max",
  "payload_bytes"}`` at evaluation points; the byte figures are per worker (mean and max over
  ranks, cumulative), wall_s is the cumulative training time of rank 0 (evaluation excluded).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class JsonlWriter:
    """Appends JSON records; on resume, drops records after the resumed step."""

    def __init__(self, path: Path, *, resume_step: int | None = None) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(k + "\n" for k in kept))
        elif path.exists():
            path.unlink()
        self._f = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 1000,
             device: torch.device | None = None) -> dict[str, float]:
    """Accuracy and mean negative log-likelihood of ``model`` on (x, y)."""
    was_training = model.training
    model.eval()
    correct, nll, n = 0, 0.0, len(y)
    for i in range(0, n, batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        if device is not None:
            xb, yb = xb.to(device), yb.to(device)
        logits = model(xb).float()
        nll += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    model.train(was_training)
    return {"accuracy": correct / n, "nll": nll / n if math.isfinite(nll) else float("inf")}
