"""IST without a restart: bytes of the kept store and time lost per failure (FaultTolerantIST).

    PYTHONPATH=src python benchmarks/ft_ist.py [--workers 4] [--rounds 12] [--die-at 5]
        [--deployment central|sharded]

Starts a lighthouse on 127.0.0.1 and ``--workers`` workers (one process each) training a
784-512-512-10 MLP on random batches with SGD through
``thinwire.strategies.ist.fault.FaultTolerantIST`` (``--deployment``, central by default;
K = ``--local-steps``, overlap 1), three times:
  1. ``keepers=1``, no failure: the subnet traffic of central IST (worker 0 stores the model),
     or, sharded, of sharded IST (each block of units on one worker);
  2. ``keepers=2``, no failure: the same with a second full copy of the store (sharded: of
     every block), which every worker's trained pieces also reach: the extra bytes of
     surviving a keeper's loss;
  3. ``keepers=2``, worker 0 (the keeper that sends the subnets) SIGKILLed after the first local
     step of round ``--die-at``: the survivors close that round without it, the next live
     worker becomes a keeper from the other keeper's copy (``recovery`` bytes), the rounds
     after it are dealt over the survivors (sharded: worker 0's blocks are copied from their
     other holders to survivors, tagged ``recovery``).
Prints, per run, the bytes sent per worker and round by ledger tag (mean over the workers that
finished) and the most any one worker sent (central: the keeper; sharded: spread), and for run
3 the time lost: the wall time from the failed round's start to its close less the median
round before it. Every process is bounded (``--timeout``) and torn down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(index: int, lighthouse: str, out: Path, a: argparse.Namespace) -> int:
    import torch

    from thinwire.strategies.ist.fault import FaultTolerantIST

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ist = FaultTolerantIST(model, opt, replica_id=f"w{index}", lighthouse=lighthouse,
                           workers=a.workers, min_workers=2, keepers=a.keepers,
                           local_steps=a.local_steps, overlap=1,
                           example_input=torch.zeros(2, 784), timeout=5.0, quorum_timeout=30.0,
                           deployment=a.deployment)
    (out / f"ready{index}").touch()
    while not all((out / f"ready{i}").exists() for i in range(a.workers)):
        time.sleep(0.02)
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    while ist.round < a.rounds:
        if ist.at_boundary:
            starts[ist.round] = time.time()
        ist.begin_round()
        if a.kill and index == 0 and (ist.round, ist.in_round) == (a.die_at, 1):
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(10_000 * index + 100 * ist.round + ist.in_round)
        x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        r = ist.round
        opt.step()
        if ist.at_boundary:
            ends[r] = time.time()
    sent: dict[str, int] = {}
    for e in ist.comm.ledger.entries:
        sent[e.tag] = sent.get(e.tag, 0) + e.sent
    ist.close()
    (out / f"w{index}.json").write_text(json.dumps(
        {"starts": starts, "ends": ends, "sent": sent, "log": ist.log}))
    return 0


def run(a: argparse.Namespace, keepers: int, kill: bool) -> dict[int, dict]:
    from thinwire.runtime.ft import Lighthouse

    with tempfile.TemporaryDirectory(prefix="ft_ist.") as tmp:
        out = Path(tmp)
        env = dict(os.environ, FT_OUT=str(out), OMP_NUM_THREADS="1", RUST_LOG="error")
        args = [sys.executable, __file__, "--workers", str(a.workers), "--rounds", str(a.rounds),
                "--die-at", str(a.die_at), "--local-steps", str(a.local_steps),
                "--keepers", str(keepers), "--deployment", a.deployment] + (
                    ["--kill"] if kill else [])
        with Lighthouse(min_workers=2, join_timeout_ms=3000, heartbeat_timeout_ms=2000) as lh:
            procs = [subprocess.Popen([*args, "--worker", str(i), lh.address], env=env,
                                      stderr=subprocess.DEVNULL) for i in range(a.workers)]
            try:
                codes = [p.wait(timeout=a.timeout) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        print(f"{a.deployment}, keepers={keepers}{' with worker 0 killed in round ' + str(a.die_at) if kill else ''}"
              f": exit codes {codes}")
        return {i: json.loads((out / f"w{i}.json").read_text())
                for i in range(a.workers) if (out / f"w{i}.json").exists()}


def report(results: dict[int, dict], rounds: int, what: str = "per worker and round"
           ) -> dict[str, float]:
    tags = sorted({t for r in results.values() for t in r["sent"]})
    per = {t: statistics.mean(r["sent"].get(t, 0) for r in results.values()) / rounds
           for t in tags}
    most = max(sum(r["sent"].values()) for r in results.values()) / rounds
    print(f"  sent {what}, by tag (mean over finishing workers): "
          + ", ".join(f"{t} {v / 1e6:.3f} MB" for t, v in per.items())
          + f"; all tags, the most any worker sent: {most / 1e6:.3f} MB")
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--die-at", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--deployment", choices=("central", "sharded"), default="central")
    ap.add_argument("--keepers", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(int(a.worker[0]), a.worker[1], Path(os.environ["FT_OUT"]), a)
    os.environ.setdefault("RUST_LOG", "error")
    t0 = time.perf_counter()
    one = report(run(a, 1, False), a.rounds)
    two = report(run(a, 2, False), a.rounds)
    extra = sum(two.values()) - sum(one.values())
    print(f"  a second keeper costs {extra / 1e6:.3f} MB per worker and round "
          f"({100 * extra / sum(one.values()):.0f}% over keepers=1)")
    killed = run(a, 2, True)
    report(killed, 1, f"per worker in all {a.rounds} rounds")
    r = killed[1]
    starts = {int(k): v for k, v in r["starts"].items()}
    ends = {int(k): v for k, v in r["ends"].items()}
    before = [ends[t] - starts[t] for t in range(1, a.die_at)]
    step = statistics.median(before)
    window = ends[a.die_at] - starts[a.die_at]
    print(f"  median round {step:.2f} s, the failed round {window:.2f} s: time lost per "
          f"failure {window - step:.2f} s; rounds (round, began, closed) around it: "
          f"{r['log'][a.die_at - 1:a.die_at + 2]}")
    print(f"({time.perf_counter() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
