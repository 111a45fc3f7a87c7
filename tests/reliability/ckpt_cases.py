"""A small real checkpoint to corrupt: what the trainer writes for 2 workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from thinwire import checkpoint


def state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    return {"strategy": {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3)},
                         "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}},
            "trainer": {"wall_s": 1.5, "sent_bytes": 10.0, "payload_bytes": 8.0, "recv_bytes": 10.0}}


def write_run(run: Path, steps: tuple[int, ...] = (5, 10), world: int = 2) -> Path:
    for step in steps:
        for r in range(world):
            checkpoint.save_rank(run, step, r, state(r))
        checkpoint.mark_complete(run, step, world)
    return run
