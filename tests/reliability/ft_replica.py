"""Test-only replica group of a fault-tolerant data-parallel run (one process).

``python ft_replica.py INDEX LIGHTHOUSE OUT STEPS [--die-at S] [--join-after S] [--codec SPEC]
[--min-workers N]``: trains a small linear model with momentum SGD through
``FaultTolerantDP``; replica INDEX's batch at step t is a pure function of (INDEX, t).
``--die-at S``: SIGKILL itself inside step S, after the quorum formed (survivors lose that
step); ``--hold S:I,J`` (repeatable): before step S, wait until replicas I, J have joined
(their OUT/ready{I} exists), so the quorum of step S holds them (the lighthouse waits for every
replica group that heartbeats), leaving OUT/holding{S}.{INDEX}; ``--after S:I,J``: start only
when replicas I, J hold at step S.
Writes OUT/replica{INDEX}.pt: the final parameters, the live replicas of every committed step,
the step at which it joined, its ledger totals by tag."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch


def batch(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * index + step)
    x = torch.randn(8, 4, generator=g)
    return x, torch.randn(8, 3, generator=g)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def residual(ft: object) -> float:
    """The size of the codec's error-feedback residuals (0 without any)."""
    state = ft.codec.state_dict()  # type: ignore[attr-defined]
    return sum(float(v.abs().sum()) for k, v in state.items() if k.startswith("residual."))


def wait_for(out: Path, names: list[str], limit: float = 60) -> bool:
    deadline = time.monotonic() + limit
    for name in names:
        while not (out / name).exists():
            if time.monotonic() > deadline:
                print(f"{name} never appeared", file=sys.stderr)
                return False
            time.sleep(0.05)
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("index", type=int)
    ap.add_argument("lighthouse")
    ap.add_argument("out")
    ap.add_argument("steps", type=int)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--hold", action="append", default=[])
    ap.add_argument("--after", default="")
    ap.add_argument("--codec", default="none")
    ap.add_argument("--min-workers", type=int, default=2)
    ap.add_argument("--quorum-timeout", type=float, default=20.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    if a.after and not wait_for(out, [f"holding{a.after.split(':')[0]}.{i}"
                                      for i in a.after.split(":")[1].split(",")]):
        return 2
    from thinwire.runtime.ft import FaultToleranceError
    from thinwire.strategies.fault import FaultTolerantDP

    model, opt = build()
    ft = FaultTolerantDP(model, opt, replica_id=f"replica{a.index}", lighthouse=a.lighthouse,
                         min_workers=a.min_workers, codec=a.codec, timeout=5.0,
                         quorum_timeout=a.quorum_timeout)
    (out / f"ready{a.index}").touch()
    live: dict[int, list[int]] = {}
    joined, at_join = -1, 0.0
    try:
        with ft:  # leaving the block closes it (quorum left, servers stopped)
            while ft.step_index < a.steps:
                held = [h for h in a.hold if int(h.split(":")[0]) == ft.step_index]
                for h in held:
                    a.hold.remove(h)
                    (out / f"holding{ft.step_index}.{a.index}").touch()
                    if not wait_for(out, [f"ready{i}" for i in h.split(":")[1].split(",")]):
                        return 2
                ft.zero_grad()
                t = ft.step_index
                if joined < 0:
                    joined, at_join = t, residual(ft)
                if t == a.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                ids = ft.comm.all_gather(torch.tensor([a.index]), tag="control")
                x, y = batch(a.index, t)
                torch.nn.functional.mse_loss(model(x), y).backward()
                if ft.step():
                    live[t] = sorted(int(i) for i in ids)
    except FaultToleranceError as exc:
        print(exc, file=sys.stderr)
        return 3
    by_tag: dict[str, int] = {}
    for e in ft.comm.ledger.entries:
        by_tag[e.tag] = by_tag.get(e.tag, 0) + e.sent + e.recv
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "live": live,
                "joined": joined, "bytes": by_tag, "dropped": ft.dropped,
                "residual": residual(ft), "residual_at_join": at_join},
               out / f"replica{a.index}.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
