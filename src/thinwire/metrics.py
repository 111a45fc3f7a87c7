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
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class JsonlWriter:
    """Appends JSON records, each flushed and synced to disk as it is written; on resume, drops
    records after the resumed step (the file is rewritten atomically).

    The file is opened with ``O_NOFOLLOW`` (a link at its path is refused, never followed). A
    failed write (ENOSPC...) is a one-line UsageError naming the file. On resume, a last line
    cut short by a crash (no final newline) is dropped; any other line that is not a record is
    a one-line UsageError naming the line, which leaves the checkpoints alone."""

    def __init__(self, path: Path, *, resume_step: int | None = None) -> None:
        from thinwire.errors import UsageError
        from thinwire.rundir import describe_os_error, write_text

        self.path = path
        if resume_step is not None and os.path.lexists(path):
            kept = _records_up_to(path, resume_step)
            write_text(path, "".join(k + "\n" for k in kept))
        elif os.path.lexists(path):
            path.unlink()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UsageError(describe_os_error(exc, path)) from None
        self._f = open(fd, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        from thinwire.errors import UsageError
        from thinwire.rundir import describe_os_error

        try:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as exc:
            raise UsageError(describe_os_error(exc, self.path)) from None

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass


def _records_up_to(path: Path, step: int) -> list[str]:
    """The lines of ``path`` whose record's step is at most ``step`` (see :class:`JsonlWriter`)."""
    from thinwire.errors import UsageError

    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"run.resume: {path} cannot be read ({why}); the checkpoints are "
                         "intact: restore the file, or move it away to resume without the "
                         "earlier records") from None
    lines = text.split("\n")
    kept = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            at = rec.get("step", 0)
            if isinstance(at, bool) or not isinstance(at, (int, float)):
                raise ValueError
        except (ValueError, AttributeError, RecursionError):
            if n == len(lines):  # the last line, without its newline: a write cut short
                continue
            raise UsageError(f"run.resume: {path} line {n} is not a metrics record (the file "
                             "is damaged); the checkpoints are intact: delete that line (or "
                             "restore the file) and resume again") from None
        if at <= step:
            kept.append(line)
    return kept


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
