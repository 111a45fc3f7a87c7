"""Atomic per-rank checkpoints and resume.

Layout: ``RUN/checkpoints/step_00000100/rank0.pt ... rankN.pt`` plus ``COMPLETE``. Every rank
writes its own state (a sharded strategy holds different parameters on each rank) to a
temporary file and renames it into place; after a barrier rank 0 writes ``COMPLETE`` the same
way. Resume takes the newest step whose ``COMPLETE`` exists, so a crash mid-write never loses
the previous checkpoint. Loading uses ``torch.load(weights_only=True)``: no arbitrary objects are
unpickled. Older complete checkpoints beyond ``keep`` are removed by rank 0.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from thinwire.errors import UsageError


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_rank(run_dir: Path, step: int, rank: int, state: dict[str, Any]) -> None:
    d = _step_dir(run_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, d / f"rank{rank}.pt")


def mark_complete(run_dir: Path, step: int, world_size: int, keep: int = 2) -> None:
    """Rank 0, after every rank saved: seal the checkpoint and prune older ones."""
    d = _step_dir(run_dir, step)
    missing = [r for r in range(world_size) if not (d / f"rank{r}.pt").exists()]
    if missing:
        raise RuntimeError(f"checkpoint {d} lacks ranks {missing}")
    atomic_write_bytes(d / "COMPLETE", f"{world_size}\n".encode())
    for old in complete_steps(run_dir)[:-keep]:
        shutil.rmtree(_step_dir(run_dir, old), ignore_errors=True)


def complete_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / "COMPLETE").exists())


def latest_step(run_dir: Path) -> int | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def load_rank(run_dir: Path, step: int, rank: int, world_size: int) -> dict[str, Any]:
    d = _step_dir(run_dir, step)
    saved_world = int((d / "COMPLETE").read_text().strip())
    if saved_world != world_size:
        raise UsageError(f"checkpoint {d} was written by {saved_world} workers, this run has "
                         f"{world_size}; resume with --runtime.workers {saved_world}")
    return torch.load(d / f"rank{rank}.pt", weights_only=True, map_location="cpu")  # type: ignore[no-any-return]
