"""Time lost per failure without a restart: data parallelism on a torchft quorum.

    PYTHONPATH=src python benchmarks/ft_recovery.py [--workers 4] [--steps 40] [--die-at 15]

Starts a lighthouse on 127.0.0.1 and ``--workers`` replica groups (one process each) training
a 256-256-10 MLP with momentum SGD through ``thinwire.strategies.fault.FaultTolerantDP``; the
last replica SIGKILLs itself inside step ``--die-at`` (after the quorum formed). Prints the
median step time before the failure, the wall time of the failed step until the survivors'
next commit, the time lost (that minus one median step), the dropped steps, and the bytes of
a survivor's ledger by tag. Every process is bounded (``--timeout``) and torn down.

    PYTHONPATH=src python benchmarks/ft_recovery.py --restart [--workers 4] [--die-at 15]

The same failure under restart-based recovery: ``thinwire train`` (dp, a 32-32 MLP on digits,
``--steps``, a checkpoint every 10 steps, ``runtime.max_restarts 1``) run once uninterrupted
and once with a worker SIGKILLed before step ``--die-at`` (the test suite's fault-injecting
worker entry, tests/reliability/faulty_worker.py); prints both wall times and their
difference, the time the restart cost."""

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


def replica(index: int, lighthouse: str, out: Path, steps: int, die_at: int,
            workers: int) -> int:
    import torch

    from thinwire.strategies.fault import FaultTolerantDP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ft = FaultTolerantDP(model, opt, replica_id=f"r{index}", lighthouse=lighthouse,
                         min_workers=2, timeout=5.0, quorum_timeout=30.0)
    (out / f"ready{index}").touch()
    while not all((out / f"ready{i}").exists() for i in range(workers)):
        time.sleep(0.02)
    commits: dict[int, float] = {}
    while ft.step_index < steps:
        ft.zero_grad()
        t = ft.step_index
        if t == die_at and index == workers - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 * index + t)
        x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if ft.step():
            commits[t] = time.time()
    by_tag: dict[str, int] = {}
    for e in ft.comm.ledger.entries:
        by_tag[e.tag] = by_tag.get(e.tag, 0) + e.sent
    ft.close()
    (out / f"r{index}.json").write_text(json.dumps(
        {"commits": commits, "dropped": ft.dropped, "sent": by_tag}))
    return 0


def restart_cost(workers: int, steps: int, die_at: int, root: Path) -> None:
    from thinwire import config as config_mod
    from thinwire import rundir
    from thinwire.launch import launch

    tests = Path(__file__).resolve().parents[1] / "tests" / "reliability"
    walls = {}
    for name, kills in (("plain", ""), ("killed", f"0:{workers - 1}:{die_at}")):
        over = {"model.name": "mlp", "data.name": "digits", "model.hidden": "32,32",
                "train.batch_size": "16", "train.steps": str(steps), "train.eval_every":
                str(steps), "train.log_every": "10", "run.checkpoint_every": "10",
                "run.progress": "false", "runtime.workers": str(workers),
                "runtime.timeout_s": "60", "method.name": "dp", "run.out": str(root),
                "run.name": name}
        cfg = config_mod.load(None, over)
        run = root / name
        run.mkdir(parents=True)
        rundir.write_text(run / "config.toml", config_mod.dumps(cfg))
        env = {"THINWIRE_TEST_KILLS": kills, "PYTHONPATH": os.pathsep.join(
            [str(tests), os.environ.get("PYTHONPATH", "")])}
        t0 = time.perf_counter()
        launch(run, workers, env=env, max_restarts=1, module="faulty_worker")
        walls[name] = time.perf_counter() - t0
    print(f"restart-based ({workers} workers, {steps} steps, checkpoint every 10, kill before "
          f"step {die_at}): uninterrupted {walls['plain']:.2f} s, with the kill "
          f"{walls['killed']:.2f} s, time lost per failure "
          f"{walls['killed'] - walls['plain']:.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--die-at", type=int, default=15)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--restart", action="store_true")
    ap.add_argument("--replica", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.restart:
        with tempfile.TemporaryDirectory(prefix="ft_restart.") as tmp:
            restart_cost(a.workers, a.steps, a.die_at, Path(tmp))
        return 0
    if a.replica:
        return replica(int(a.replica[0]), a.replica[1], Path(os.environ["FT_OUT"]), a.steps,
                       a.die_at, a.workers)
    os.environ.setdefault("RUST_LOG", "error")
    with tempfile.TemporaryDirectory(prefix="ft_recovery.") as tmp:
        return quorum_cost(a, Path(tmp))


def quorum_cost(a: argparse.Namespace, out: Path) -> int:
    from thinwire.runtime.ft import Lighthouse

    env = dict(os.environ, FT_OUT=str(out), OMP_NUM_THREADS="1", RUST_LOG="error")
    with Lighthouse(min_workers=2, join_timeout_ms=3000, heartbeat_timeout_ms=2000) as lh:
        procs = [subprocess.Popen([sys.executable, __file__, "--workers", str(a.workers),
                                   "--steps", str(a.steps), "--die-at", str(a.die_at),
                                   "--replica", str(i), lh.address], env=env,
                                  stderr=subprocess.DEVNULL)
                 for i in range(a.workers)]
        try:
            codes = [p.wait(timeout=a.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    r = json.loads((out / "r0.json").read_text())
    c = {int(k): v for k, v in r["commits"].items()}
    before = [c[t] - c[t - 1] for t in range(2, a.die_at)]
    step = statistics.median(before)
    window = c[a.die_at] - c[a.die_at - 1]
    print(f"exit codes {codes} (the last replica SIGKILLed: -9)")
    print(f"workers {a.workers} -> {a.workers - 1}, median step {step * 1000:.1f} ms, "
          f"failed step until next commit {window:.2f} s, time lost per failure "
          f"{window - step:.2f} s, dropped steps {r['dropped']}")
    print("survivor 0 sent bytes by tag:", r["sent"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
