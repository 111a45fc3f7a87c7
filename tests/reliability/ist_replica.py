"""Test-only worker of a fault-tolerant IST run (one process).

``python ist_replica.py INDEX LIGHTHOUSE OUT ROUNDS [--die-at R] [--hold R:I,J] [--after R:I,J]
[--lr LR] [--momentum M] [--overlap O] [--workers N] [--keepers N] [--outer LR:M]
[--deployment D]``: trains a 4-12-3 MLP
with SGD through ``FaultTolerantIST`` (K = 2 local steps a round, dropout scaling, the momentum
buffers dealt with their units); worker INDEX's batch at local step s of round r is a pure
function of (INDEX, r, s). ``--die-at R``: SIGKILL itself after the first local step of round
R (mid-round); ``--hold R:I,J`` (repeatable): at the boundary before round R, wait until
workers I, J are up (their OUT/ready{I} exists), leaving OUT/holding{R}.{INDEX}; ``--after
R:I,J``: start only when workers I, J hold before round R. ``--outer LR:M``: IST's outer
optimizer (``outer_lr``, ``outer_momentum``).
Writes OUT/worker{INDEX}.pt: a keeper's stored model before ``finish()`` (None on other
workers), the full model after, the log of closed rounds, the round it joined at, the keepers
(sharded: each block's holders too), the checkpoint writer's one-worker state (None on other
workers), its ledger totals by tag."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from ft_replica import wait_for  # beside this file: the run as a script puts it on the path

K = 2
HIDDEN = 12


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 3))


def batch(index: int, round_: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * index + 100 * round_ + step)
    x = torch.randn(8, 4, generator=g)
    return x, torch.randn(8, 3, generator=g)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("index", type=int)
    ap.add_argument("lighthouse")
    ap.add_argument("out")
    ap.add_argument("rounds", type=int)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--hold", action="append", default=[])
    ap.add_argument("--after", default="")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--overlap", type=int, default=1)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--keepers", type=int, default=2)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--deployment", default="central")
    ap.add_argument("--outer", default="1:0")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    if a.after and not wait_for(out, [f"holding{a.after.split(':')[0]}.{i}"
                                      for i in a.after.split(":")[1].split(",")], 120):
        return 2
    from thinwire.runtime.ft import FaultToleranceError
    from thinwire.strategies.ist.fault import FaultTolerantIST

    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    ist = FaultTolerantIST(model, opt, replica_id=f"worker{a.index}", lighthouse=a.lighthouse,
                           workers=a.workers, min_workers=2, keepers=a.keepers, local_steps=K,
                           overlap=a.overlap, example_input=torch.zeros(2, 4), timeout=5.0,
                           quorum_timeout=20.0, outer_lr=float(a.outer.split(":")[0]),
                           outer_momentum=float(a.outer.split(":")[1]), deployment=a.deployment)
    (out / f"ready{a.index}").touch()
    try:
        while ist.round < a.rounds:
            for h in [h for h in a.hold if int(h.split(":")[0]) == ist.round]:
                a.hold.remove(h)
                (out / f"holding{ist.round}.{a.index}").touch()
                if not wait_for(out, [f"ready{i}" for i in h.split(":")[1].split(",")], 120):
                    return 2
            ist.begin_round()  # explicit: a joiner learns the round here
            if (ist.round, ist.in_round) == (a.die_at, 1):
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(a.index, ist.round, ist.in_round)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        stored = ist.full_tensors()  # a keeper's own copy (None elsewhere)
        ist.finish()
        # the checkpoint writer's one-worker state (sharded: assembled by finish)
        written = ist.state_dict() if ist.writes_checkpoint else None
    except FaultToleranceError as exc:
        print(exc, file=sys.stderr)
        return 3
    finally:
        ist.close()
    by_tag: dict[str, int] = {}
    for e in ist.comm.ledger.entries:
        by_tag[e.tag] = by_tag.get(e.tag, 0) + e.sent + e.recv
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "log": ist.log,
                "joined": ist.joined_at, "keepers": ist.keepers, "stored": stored,
                "holders": getattr(ist, "holders", None), "written": written,
                "bytes": by_tag},
               out / f"worker{a.index}.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
